"""What the harness attaches to one ``generate()`` run: a per-step probe and a per-update tee.

* :class:`StepProbe` is a ``LogitsProcessor``: ``generate`` calls it exactly once per step, after
  the forward and before the next tokens are chosen, with the running ids ``[rows, length]``. It
  records the step's wall time, the cache's KV bytes and the ids' last column, and returns the
  scores unchanged (so the run is the same ``generate`` as without it).
* :class:`UpdateTee` wraps one cache object's ``update`` and keeps, per (step, layer), a digest of
  every row of the K/V it returned (or, for the paged layout, of what the layer stores). Digests
  are exact (BLAKE2b of the row's shape, dtype and bytes), so two runs compare bit for bit without
  keeping the tensors.

The time both spend on their own bookkeeping is measured and left out of the step times.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import LogitsProcessor
from transformers.cache_utils import Cache

from ..config_values import each_layer
from ..memory.errors import ArgumentError

__all__ = ["LayerDigest", "StepProbe", "TeeSource", "UpdateTee", "kv_bytes", "kv_bytes_per_token", "row_digests"]

#: ``"returned"``: digest what ``update`` returns (what attention reads in the contiguous layout);
#: ``"stored"``: digest the layer's ``keys``/``values`` after the update (layout independent).
TeeSource = Literal["returned", "stored"]


def kv_bytes(cache: Cache) -> int:
    """Physical KV bytes a cache holds now.

    A :class:`~hf_vkv.VKVCache` reports its resident pages (a page shared by several rows counts
    once); any other cache the bytes of its layers' ``keys``/``values`` tensors.
    """
    from ..cache import VKVCache

    if isinstance(cache, VKVCache):
        return cache.stats().resident_bytes
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of K and V one token of one row holds in a DynamicCache, all layers together.

    From the model's shape: layers x (K, V) x KV heads x head dim x the parameters' item size.
    Exact for models whose every layer keeps every token (full attention); a sliding-window
    layer holds at most its window, so for those this is the bytes per token below the window.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv, q, dims = (each_layer(cfg, name, cfg.num_hidden_layers)  # per layer: Gemma 4's head dims differ
                   for name in ("num_key_value_heads", "num_attention_heads", "head_dim"))
    return 2 * sum((k or h) * (d or cfg.hidden_size // h) for k, h, d in zip(kv, q, dims)) * model.dtype.itemsize


def row_digests(states: torch.Tensor) -> tuple[bytes, ...]:
    """One 16-byte digest per row of ``states`` (``[B, ...]``, any dtype and device): equal
    digests mean equal shape, dtype and bytes of that row."""
    states = states.detach()
    if states.device.type != "cpu":
        states = states.cpu()
    header = f"{tuple(states.shape[1:])}|{states.dtype}|".encode()
    raw = states.contiguous().view(torch.uint8)  # [B, ..., D * itemsize]: any dtype as bytes
    out = []
    for row in raw:
        h = hashlib.blake2b(header, digest_size=16)
        h.update(memoryview(row.numpy()))
        out.append(h.digest())
    return tuple(out)


@dataclass(frozen=True, slots=True)
class LayerDigest:
    """One layer's K/V at one step: a digest per row of each."""

    keys: tuple[bytes, ...]
    values: tuple[bytes, ...]


class UpdateTee:
    """Records :class:`LayerDigest`\\ s of every ``update`` of one cache: ``digests[layer][step]``.

    The step of an update is the number of earlier updates of the same layer (one forward per
    generation step, so it matches :class:`StepProbe`'s step). Attach with :meth:`attach`, which
    shadows the cache object's ``update`` method; :meth:`detach` restores it.
    """

    def __init__(self, *, source: TeeSource = "returned") -> None:
        if source not in ("returned", "stored"):
            raise ArgumentError(f"source must be 'returned' or 'stored', got {source!r}")
        self.source = source
        self.digests: dict[int, list[LayerDigest]] = {}
        self.overhead_s = 0.0  # time spent digesting (left out of step times)

    def attach(self, cache: Cache) -> None:
        """Start recording ``cache.update`` (an instance attribute shadows the method)."""
        original = cache.update

        def update(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = original(key_states, value_states, layer_idx, *args, **kwargs)
            t0 = time.perf_counter()
            if self.source == "stored":
                layer = cache.layers[layer_idx]
                seen_k, seen_v = layer.keys, layer.values
            else:
                seen_k, seen_v = keys, values
            self.digests.setdefault(layer_idx, []).append(LayerDigest(row_digests(seen_k), row_digests(seen_v)))
            self.overhead_s += time.perf_counter() - t0
            return keys, values

        cache.update = update  # type: ignore[method-assign]

    @staticmethod
    def detach(cache: Cache) -> None:
        """Stop recording (drops the instance attribute, and with it the reference cycle)."""
        vars(cache).pop("update", None)


class StepProbe(LogitsProcessor):
    """Called once per step by ``generate``; records time, KV bytes and the running ids' last column.

    Step ``t``'s time runs from the end of the probe's previous call (for step 0: :meth:`start`,
    just before ``generate``) to the start of this one, minus the tee's digest time in between.
    So step 0 holds generate's set-up and the prefill; step ``t >= 1`` holds the previous step's
    token choice and cache reorder, and this step's forward.
    """

    def __init__(self, cache: Cache, *, tee: UpdateTee | None = None, progress: Any = None,
                 histories: bool = False) -> None:
        self.cache = cache
        self.tee = tee
        self.progress = progress  # a progress.Progress (or None), advanced once per step
        self.times: list[float] = []
        self.kv_bytes: list[int] = []
        self.last_ids: list[torch.Tensor] = []  # [rows] each: ids[:, -1] seen at each step (CPU)
        # with ``histories`` (beam search: rows are beams, which generate reorders), each step's
        # whole ``[rows, length]`` ids (CPU): a row's history identifies its beam
        self.histories: list[torch.Tensor] | None = [] if histories else None
        self._mark = 0.0
        self._overhead_seen = 0.0

    def start(self) -> None:
        """Mark the start of step 0 (call right before ``generate``)."""
        self._overhead_seen = self.tee.overhead_s if self.tee else 0.0
        self._mark = time.perf_counter()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids``: ``[rows, length]``; ``scores``: ``[rows, vocab]``, returned as is."""
        now = time.perf_counter()
        overhead = self.tee.overhead_s if self.tee else 0.0
        self.times.append(now - self._mark - (overhead - self._overhead_seen))
        self._overhead_seen = overhead
        self.kv_bytes.append(kv_bytes(self.cache))
        self.last_ids.append(input_ids[:, -1].detach().to("cpu", copy=True))
        if self.histories is not None:
            self.histories.append(input_ids.detach().to("cpu", copy=True))
        if self.progress is not None:
            self.progress.update(1)
        self._mark = time.perf_counter()
        return scores

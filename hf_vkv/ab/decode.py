"""Decode-step timing of several caches over one prompt, interleaved, checked against DynamicCache.

A cell of the benchmark is a prompt length ``P`` and a batch ``B``. Prefilling ``P x B`` tokens
once per cache costs far more than the decode steps it precedes (8192 x 8 tokens on two cores
take many minutes), so a cell is measured like this:

1. :func:`prefill` runs the model once over ``n <= B`` distinct prompts (in chunks) with a
   DynamicCache and keeps every layer's prompt K/V ``[n, H, P, D]`` and each row's first decode
   token. Cells with more rows than distinct prompts repeat them (row ``r`` is prompt ``r % n``).
2. :func:`load_prompt` writes that K/V into each cache through its own ``update()``, layer by
   layer: the cache's real write path, the same one a prefill takes.
3. :func:`time_decode` runs ``rounds`` rounds; a round crops every cache back to the prompt and
   decodes ``new_tokens`` steps, interleaved (step ``t`` of every cache, then step ``t + 1``; the
   order of the caches rotates each round), each step one ``model.forward`` of ``[B, 1]`` tokens.
   All caches are fed DynamicCache's tokens (teacher forcing), and every cache's argmax must
   equal DynamicCache's at every step: a cache that diverges is reported as such.

Only the decode forwards are timed, with the caller's thread setting (the benchmark uses one
intra-op thread). The result per cache is the median over rounds of the mean step time.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from ..generate import cache_kwarg
from ..memory.errors import ArgumentError

__all__ = ["CacheTiming", "Prompt", "load_prompt", "prefill", "time_decode"]

#: Builds one cache for ``batch`` rows of ``capacity`` tokens: ``factory(model, batch, capacity)``.
CacheFactory = Callable[[PreTrainedModel, int, int], Cache]
#: The KV bytes a cache holds now (each cache kind counts its own way).
KVBytes = Callable[[Cache], int]


@dataclass(frozen=True, slots=True)
class Prompt:
    """The prefilled prompt of a cell: ``keys[l]`` / ``values[l]`` ``[n, H, P, D]``, and
    ``first_tokens`` ``[n]`` (each row's argmax after the prompt)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    first_tokens: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @property
    def distinct_rows(self) -> int:
        return self.keys[0].shape[0]

    def rows(self, batch: int) -> torch.Tensor:
        """``[batch]`` indices into the distinct rows (row ``r`` is prompt ``r % n``)."""
        return torch.arange(batch) % self.distinct_rows


@dataclass(slots=True)
class CacheTiming:
    """What :func:`time_decode` measured for one cache (seconds, bytes)."""

    name: str
    round_step_s: list[float] = field(default_factory=list)  # mean decode step of each round
    kv_peak_bytes: int = 0  # most KV bytes seen at the end of a round
    kv_end_bytes: int = 0  # KV bytes at the end of the last round
    tokens_equal: bool = True  # argmax equal to DynamicCache's at every step of every round
    first_mismatch: str | None = None  # "round r, step t, row i: token x instead of y"
    max_abs_logit_diff: float = 0.0  # against DynamicCache, over all steps (information; 0 = bit-identical)
    extra: dict[str, float] = field(default_factory=dict)  # e.g. the vkv cache's utilization

    @property
    def step_s(self) -> float:
        """Median over rounds of the mean decode step."""
        return statistics.median(self.round_step_s)


@torch.inference_mode()
def prefill(model: PreTrainedModel, input_ids: torch.Tensor, *, chunk: int = 2048) -> Prompt:
    """Run ``input_ids`` ``[n, P]`` through ``model`` in chunks of ``chunk`` tokens with a
    DynamicCache; return the prompt's K/V and first tokens (see :class:`Prompt`)."""
    cache = DynamicCache(config=model.config)
    logits = None
    for start in range(0, input_ids.shape[1], chunk):
        part = input_ids[:, start : start + chunk]
        logits = model(input_ids=part, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1).logits
    assert logits is not None
    keys = tuple(layer.keys for layer in cache.layers)
    values = tuple(layer.values for layer in cache.layers)
    return Prompt(keys=keys, values=values, first_tokens=logits[:, -1].argmax(-1))


@torch.inference_mode()
def load_prompt(caches: Mapping[str, Cache], prompt: Prompt, batch: int) -> None:
    """Write the prompt's K/V for ``batch`` rows into every cache with its ``update()``, one layer
    at a time (one layer's ``[batch, H, P, D]`` copy exists at a time)."""
    rows = prompt.rows(batch)
    for layer, (k, v) in enumerate(zip(prompt.keys, prompt.values)):
        k_rows, v_rows = k.index_select(0, rows), v.index_select(0, rows)
        for cache in caches.values():
            cache.update(k_rows, v_rows, layer)
        del k_rows, v_rows


@torch.inference_mode()
def time_decode(model: PreTrainedModel, caches: Mapping[str, Cache], prompt: Prompt, *, batch: int,
                new_tokens: int, rounds: int, kv_bytes: Mapping[str, KVBytes],
                extra: Mapping[str, Callable[[Cache], dict[str, float]]] | None = None,
                reference: str = "dynamic") -> dict[str, CacheTiming]:
    """Decode ``new_tokens`` steps ``rounds`` times with every cache, interleaved (module docstring).

    Args:
        caches: name -> a cache holding the prompt (:func:`load_prompt`); ``reference`` among them.
        kv_bytes: name -> how to count that cache's KV bytes (read at the end of each round).
        extra: name -> numbers to record at the end of the last round (e.g. utilization).

    Returns:
        name -> :class:`CacheTiming`, in the order of ``caches``.
    """
    if reference not in caches:
        raise ArgumentError(f"the reference cache {reference!r} is not among {list(caches)}: name one of them")
    names = list(caches)
    out = {name: CacheTiming(name=name) for name in names}
    first = prompt.first_tokens.index_select(0, prompt.rows(batch))  # [batch]
    length = prompt.length
    for r in range(rounds):
        if r:
            for cache in caches.values():
                cache.crop(-new_tokens)
        gc.collect()
        # the reference first (its token feeds the others at the same step), the others rotated
        order = _rotated([reference, *(n for n in names if n != reference)], r)
        gc_was_enabled = gc.isenabled()
        gc.disable()  # no collection inside a timed step
        try:
            spent = _round(model, caches, order, first, length, new_tokens,
                           check=lambda name, t, *got: _check(out[name], r, t, *got))
        finally:
            if gc_was_enabled:
                gc.enable()
        for name, cache in caches.items():
            timing = out[name]
            timing.round_step_s.append(spent[name] / new_tokens)
            timing.kv_end_bytes = kv_bytes[name](cache)
            timing.kv_peak_bytes = max(timing.kv_peak_bytes, timing.kv_end_bytes)
    for name, fn in (extra or {}).items():
        out[name].extra.update(fn(caches[name]))
    return out


def _round(model: PreTrainedModel, caches: Mapping[str, Cache], order: Sequence[str], first: torch.Tensor,
           length: int, new_tokens: int, *, check: Callable[..., None]) -> dict[str, float]:
    """``new_tokens`` decode steps of every cache, in ``order`` at each step (``order[0]`` is the
    reference, whose tokens feed every cache), from ``first`` ``[B]`` at position ``length``;
    returns the seconds each cache spent. ``check(name, step, tokens, ref_tokens, logits,
    ref_logits)`` sees every other cache's step."""
    batch = first.shape[0]
    spent = dict.fromkeys(order, 0.0)
    tokens = first
    for t in range(new_tokens):
        ids = tokens[:, None]
        positions = torch.full((batch, 1), length + t, dtype=torch.long)
        mask = torch.ones(batch, length + t + 1, dtype=torch.long)
        for k, name in enumerate(order):
            t0 = time.perf_counter()
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           **{cache_kwarg(): caches[name]}, use_cache=True, logits_to_keep=1).logits[:, -1]
            chosen = logits.argmax(-1)
            spent[name] += time.perf_counter() - t0
            if k == 0:
                ref_logits, ref_tokens = logits, chosen
            else:
                check(name, t, chosen, ref_tokens, logits, ref_logits)
        tokens = ref_tokens
    return spent


def _rotated(order: Sequence[str], r: int) -> list[str]:
    """The reference first, then the others rotated by the round (no cache always runs right
    after the reference)."""
    rest = list(order[1:])
    if rest:
        k = r % len(rest)
        rest = rest[k:] + rest[:k]
    return [order[0], *rest]


def _check(timing: CacheTiming, r: int, t: int, chosen: torch.Tensor, ref_tokens: torch.Tensor,
           logits: torch.Tensor, ref_logits: torch.Tensor) -> None:
    diff = float((logits - ref_logits).abs().max())
    timing.max_abs_logit_diff = max(timing.max_abs_logit_diff, diff)
    if timing.tokens_equal and not torch.equal(chosen, ref_tokens):
        row = int((chosen != ref_tokens).nonzero()[0])
        timing.tokens_equal = False
        timing.first_mismatch = (f"round {r}, step {t}, row {row}: token {int(chosen[row])} "
                                 f"instead of {int(ref_tokens[row])}")

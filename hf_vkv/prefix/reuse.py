"""Prefix reuse inside ``generate()``: ``cache_config={"prefix_store": store}`` and nothing else.

With a :class:`~hf_vkv.PrefixStore` in ``cache_config``, every ``generate(cache_implementation=
"vkv")`` call (and so every ``pipeline("text-generation")`` call, chat messages included):

1. builds its cache in the store's memory (:meth:`PrefixStore.memory`, the store's layout), so
   rows can share the entries' pages (:func:`memory_for`, called when generate makes its cache);
2. at the prefill (:func:`prefill`, the wrapper of ``GenerationMixin._prefill``): when two or
   more different prompts share a leading run of tokens the store does not hold yet (a document
   and several questions), prefills that run once, batch 1, and stores it; looks up each unique
   prompt's longest stored prefix (by exact token ids, at most all but its last token); starts
   every row from it (:meth:`VKVCache.take_rows`: the entry's pages, shared; a left-padded row's
   prefix sits at an unaligned offset and is copied); and hands transformers' own prefill (through
   prefill once, :mod:`hf_vkv.prefill_once`) a cache that already holds ``C`` tokens, so only the
   rest is computed. Rows with different reused lengths start from the smallest common column
   ``C = min(padding + reused)``: the longer ones compute a few stored tokens again.
3. after ``generate`` returns (:func:`generate`, its wrapper): inserts each finished row (prompt
   and answer, up to its first end-of-sequence token; beams: the prompt only) into the store, as a
   fork when the row is not padded and as a copy when it is, within the store's budget.

Where reuse cannot apply, the call runs exactly as without a store and :func:`last_report` says
why: encoder-decoder models (the decoder's K/V depend on the encoder's input, which the store's
keys do not hold), sliding-window or recurrent layers, the static layout, ``inputs_embeds`` or
other per-row model inputs (images: token ids do not identify them), an attention mask that is
not left padding, a model other than the store's.

Exactness: the rows' new tokens attend to K/V computed in an earlier call (another batch, decode
steps for answers), so logits are not DynamicCache's full prefill bit for bit; the contract is the
cascade's — tokens identical to DynamicCache's on the battery of chats in
``tests/integration/test_prefix_reuse.py`` (where float32 logits also stay within 1e-5 on a tiny
Llama), max |Δlogit| measured by ``run_ab(..., prefix_store=store)`` (``hf-vkv ab --reuse``; beams
compared beam by beam) and written per dtype in ``docs/prefix_reuse.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import devices, prefill_once
from ..cache import VKVCache
from ..cache.cache import RowSource
from ..cache.options import PREFIX_STORE_KEY
from ..registration import CACHE_NAMES, cache_kwarg
from .fingerprint import config_fingerprint
from .store import PrefixStore

__all__ = ["ReuseReport", "attach", "generate", "insert_finished", "last_report", "memory_for",
           "prefill", "split_prefix_store"]

#: Inputs of ``generate`` besides the token ids that reuse understands (every other per-row
#: tensor, e.g. ``pixel_values``, is not identified by the token ids: reuse steps aside).
_KNOWN_INPUTS = frozenset({"attention_mask", "position_ids", "cache_position"})


@dataclass(slots=True)
class ReuseReport:
    """What prefix reuse did in one ``generate`` call (:func:`last_report`)."""

    refusal: str | None = None  # why reuse did not apply (None: it did)
    rows: int = 0  # rows of the prefill (after num_beams / num_return_sequences expansion)
    prompt_tokens: int = 0  # tokens of the prompts (padding excluded), every row
    reused_tokens: int = 0  # of those, taken from the store (every row)
    computed_tokens: int = 0  # prompt tokens the prefill computed (common prefixes included)
    common_prefix_tokens: int = 0  # tokens of a prefix shared by the batch, prefilled once first
    start_column: int = 0  # the column every row started from (C)
    copied_rows: int = 0  # rows whose prefix was copied (left padding), not shared
    inserted: int = 0  # rows inserted into the store afterwards
    seconds_to_start: float = 0.0  # lookups, common prefix and take_rows, before the model's prefill


@dataclass(slots=True, eq=False)
class _Call:
    store: PrefixStore
    cache: VKVCache
    num_beams: int
    report: ReuseReport
    input_ids: torch.Tensor | None = None  # the prefill's [rows, T] ids
    pads: list[int] = field(default_factory=list)  # left padding of each row
    eos: frozenset[int] = frozenset()
    prefilled: bool = False


_calls: weakref.WeakKeyDictionary[VKVCache, _Call] = weakref.WeakKeyDictionary()
_frame: contextvars.ContextVar[list[_Call] | None] = contextvars.ContextVar("hf_vkv_reuse_frame", default=None)
_last = threading.local()
_calls_lock = threading.Lock()


def last_report() -> ReuseReport | None:
    """The report of the last ``generate`` call with a prefix store in this thread."""
    return getattr(_last, "report", None)


# --------------------------------------------------------------------------------- generate's cache
def split_prefix_store(config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(the prefix store of cache_config or None, the other options)``; ``TypeError`` for a
    ``prefix_store`` that is not a :class:`~hf_vkv.PrefixStore`."""
    rest = dict(config)
    store = rest.pop(PREFIX_STORE_KEY, None)
    if store is not None and not isinstance(store, PrefixStore):
        raise TypeError(f"cache_config[{PREFIX_STORE_KEY!r}] must be a hf_vkv.PrefixStore, got "
                        f"{type(store).__name__}: store = hf_vkv.PrefixStore(model.config, budget_bytes=...)")
    return store, rest


def _model_refusal(model: Any, store: PrefixStore) -> str | None:
    if model.config.is_encoder_decoder:
        return ("an encoder-decoder model: the decoder's K/V depend on the encoder's input, which the store's "
                "keys (decoder token ids) do not hold")
    if config_fingerprint(model.config) != store.config_fingerprint:
        return "the store was made for another model (config fingerprints differ)"
    return None


def memory_for(model: Any, store: PrefixStore, cache_config: dict[str, Any]) -> VKVCache | None:
    """Where ``generate``'s cache for ``model`` takes its memory from: the store's (and its
    layout, unless ``cache_config`` names one), or ``None`` where reuse does not apply."""
    if _model_refusal(model, store) is not None:
        return None
    if cache_config.get("layout") is None:
        cache_config["layout"] = store.cache_config.get("layout") or "contiguous"
    return store.memory(model.device)


def attach(cache: Any, store: PrefixStore, model: Any, *, num_beams: int, eos_token_id: Any) -> ReuseReport:
    """Make ``cache`` (a VKVCache made with :func:`memory_for`'s memory) reuse ``store``'s
    prefixes at ``generate``'s prefill; inside a ``generate`` call the finished rows go into the
    store afterwards, otherwise :func:`insert_finished` does it. Returns the call's report."""
    report = ReuseReport(refusal=_model_refusal(model, store))
    call = _Call(store=store, cache=cache, num_beams=num_beams or 1, report=report)
    eos = eos_token_id
    call.eos = frozenset([eos] if isinstance(eos, int) else [int(e) for e in (eos if eos is not None else [])])
    with _calls_lock:
        _calls[cache] = call
    frame = _frame.get()
    if frame is not None:
        frame.append(call)
    _last.report = report
    return report


def _call_of(model_kwargs: dict) -> _Call | None:
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if cache is not None:
            with _calls_lock:
                return _calls.get(cache) if isinstance(cache, VKVCache) else None
    return None


# --------------------------------------------------------------------------------- the prefill
def prefill(original: Any, model: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict,
            *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin._prefill`` (``original``): with a prefix store, rows start from their
    stored prefixes first (see the module docstring); then prefill once (which runs ``original``)."""
    call = _call_of(model_kwargs)
    if call is not None and not call.prefilled:
        call.prefilled = True
        started = time.perf_counter()
        reason = call.report.refusal or _start_rows(call, model, input_ids, model_kwargs)
        call.report.seconds_to_start = time.perf_counter() - started
        call.report.refusal = reason
    outputs = prefill_once.prefill(original, model, input_ids, generation_config, model_kwargs, *args, **kwargs)
    if call is not None and call.input_ids is not None and call.report.refusal is None:
        cache = call.cache
        if cache.prompt_repeats > 1:  # prefill once counted what it computed
            computed = cache.stats().prompt_tokens_computed
        else:
            computed = call.input_ids.shape[0] * (call.input_ids.shape[1] - call.report.start_column)
        call.report.computed_tokens += computed
        call.store.count_prefill(prompt_tokens=call.report.prompt_tokens, computed=call.report.computed_tokens)
    return outputs


def _pads(input_ids: torch.Tensor, model_kwargs: dict) -> list[int] | None:
    """Each row's left padding, or ``None`` when the attention mask is not left padding."""
    mask = model_kwargs.get("attention_mask")
    rows, length = input_ids.shape
    if mask is None:
        return [0] * rows
    if mask.dim() != 2 or tuple(mask.shape) != (rows, length):
        return None
    mask = mask.to("cpu").bool()
    pads = (~mask).sum(dim=1)
    if not torch.equal(mask, torch.arange(length)[None, :] >= pads[:, None]):
        return None
    return [int(p) for p in pads.tolist()]


def _layout_refusal(cache: VKVCache, model_kwargs: dict, rows: int) -> str | None:
    if cache.get_seq_length():
        return "the cache already holds tokens"
    if any(group.sliding_window is not None for group in cache.groups):
        return "sliding-window layers: a stored prefix's window may be gone (reuse takes full-attention models)"
    if cache.stats().transformers_layers:
        return "layers kept by transformers (recurrent or linear-attention state) cannot start from stored pages"
    if cache.layout == "static":
        return "the static layout (compiled steps)"
    for key, value in model_kwargs.items():
        if key in _KNOWN_INPUTS or key in CACHE_NAMES or not isinstance(value, torch.Tensor):
            continue
        if key == "inputs_embeds" or (value.dim() and value.shape[0] == rows):
            return f"the model input {key!r} is not identified by token ids"
    return None


def _start_rows(call: _Call, model: Any, input_ids: torch.Tensor, model_kwargs: dict) -> str | None:
    """Fill ``call.cache`` from the store; return why it could not (``None``: it did)."""
    cache, store, report = call.cache, call.store, call.report
    rows, length = input_ids.shape
    report.rows = rows
    reason = _layout_refusal(cache, model_kwargs, rows)
    if reason is not None:
        return reason
    pads = _pads(input_ids, model_kwargs)
    if pads is None:
        return "the attention mask is not left padding"
    call.input_ids, call.pads = input_ids, pads
    report.prompt_tokens = sum(length - p for p in pads)
    k = cache.prompt_repeats
    if k > 1 and prefill_once.repeats_refusal(input_ids, model_kwargs, k) is not None:
        k = 1  # rows that do not repeat their prompt: each row is its own
    unique = list(range(0, rows, k))
    ids = input_ids.to("cpu")
    tokens = {u: ids[u, pads[u]:].tolist() for u in unique}
    if len(unique) > 1:
        report.common_prefix_tokens = _store_common_prefix(model, store, [tokens[u] for u in unique])
        report.computed_tokens += report.common_prefix_tokens
    with contextlib.ExitStack() as borrowed:  # the entries, read in place while the store is locked
        found = {u: borrowed.enter_context(store.borrow(tokens[u])) for u in unique}
        column = min(pads[u] + m for u, (_, m) in found.items())
        report.start_column = column
        if column == 0:
            return None  # nothing stored yet: a full prefill, whose rows are stored afterwards
        sources = []
        for row in range(rows):
            u = row - row % k
            sources.append(RowSource(found[u][0] if column > pads[u] else None, offset=pads[u]))
        report.copied_rows = cache.take_rows(sources, length=column)
    report.reused_tokens = sum(max(column - p, 0) for p in pads)
    return None


def _common_length(sequences: list[list[int]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for other in sequences[1:]:
        i = 0
        while i < n and other[i] == first[i]:
            i += 1
        n = i
    return n


def _store_common_prefix(model: Any, store: PrefixStore, prompts: list[list[int]]) -> int:
    """Prefill the tokens every prompt starts with (at most all but the shortest's last) once,
    batch 1, over what the store holds of them, and store them; return the tokens computed."""
    shared = min(_common_length(prompts), min(len(p) for p in prompts) - 1)
    if shared < devices.MIN_COMMON_PREFIX:
        return 0
    tokens = prompts[0][:shared]
    if store.longest_prefix(tokens + [0]) >= shared:
        return 0  # stored already

    cache = store.lookup(tokens)
    try:
        held = cache.get_seq_length()
        if shared - held < devices.MIN_COMMON_PREFIX:
            cache.close()
            return 0
        device = model.device
        kwargs: dict[str, Any] = {cache_kwarg(): cache, "use_cache": True}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kwargs["logits_to_keep"] = 1  # only the K/V are wanted
        model(input_ids=torch.tensor([tokens[held:]], device=device),
              position_ids=torch.arange(held, shared, device=device)[None], **kwargs)
    except BaseException:
        cache.close()
        raise
    store.insert(tokens, cache, give=True)
    return shared - held


# --------------------------------------------------------------------------------- after generate
def generate(original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin.generate`` (``original``), then each cache that reused a store inserts
    its finished rows into it (see the module docstring)."""
    frame: list[_Call] = []
    token = _frame.set(frame)
    try:
        out = original(model, *args, **kwargs)
    finally:
        _frame.reset(token)
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    for call in frame:
        _finish(call, sequences)
    return out


def insert_finished(cache: VKVCache, sequences: torch.Tensor) -> int:
    """After a ``generate`` whose ``cache`` was :func:`attach`-ed outside a ``generate`` call (the
    A/B harness builds its caches first): insert its finished rows; return how many."""
    with _calls_lock:
        call = _calls.get(cache)
    return 0 if call is None else _finish(call, sequences)


def _finish(call: _Call, sequences: Any) -> int:
    try:
        if call.report.refusal is None and call.input_ids is not None and isinstance(sequences, torch.Tensor):
            call.report.inserted = _insert_rows(call, sequences)
        return call.report.inserted
    finally:
        with _calls_lock:
            _calls.pop(call.cache, None)


def _insert_rows(call: _Call, sequences: torch.Tensor) -> int:
    """Insert the finished rows of ``call.cache`` (their ids in ``sequences``); return how many."""
    cache, store, ids = call.cache, call.store, call.input_ids
    assert ids is not None
    held = cache.get_seq_length()
    prompt = ids.shape[1]
    if call.num_beams > 1:  # rows were reordered by beams: store each prompt, which all its beams share
        k = cache.prompt_repeats
        rows = [(r, ids[r].tolist(), prompt) for r in range(0, ids.shape[0], k)]
    elif sequences.shape[0] == cache.rows:
        seq = sequences.to("cpu")
        rows = []
        for r in range(cache.rows):
            row = seq[r].tolist()
            end = held
            for i in range(prompt, held):
                if row[i] in call.eos:
                    end = i + 1
                    break
            rows.append((r, row, end))
    else:
        return 0
    inserted = 0
    for r, row, end in rows:
        pad = call.pads[r]
        if end - pad < 1:
            continue
        if pad == 0 and cache.rows == 1:
            inserted += bool(store.insert(row[:end], cache))  # a fork of the cache itself
            continue
        one = store.new_cache(batch_size=1)
        try:
            one.take_rows([RowSource(cache, row=r, start=pad)], length=end - pad)
        except BaseException:
            one.close()
            raise
        inserted += bool(store.insert(row[pad:end], one, give=True))  # the store keeps it: no second fork
    return inserted

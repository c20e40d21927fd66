"""``GenerateCall``: the one record of a ``generate()`` call that uses a vkv cache.

The hook that builds ``generate``'s cache (``_prepare_cache`` in :mod:`hf_vkv.generate.registry`, or
:func:`begin` for a cache made first, as the A/B harness does) creates it and puts it on that
cache as ``cache.call``: the prefill (prefix reuse, prefill once) and the end of the decoding loop
(inserting finished rows into the store) read it from the cache that transformers hands them in
``model_kwargs`` — explicitly, the way nano-vllm's ``Sequence`` or vLLM's ``Request`` carries a
request. The record does not refer to its cache (no reference cycle: a cache dropped by a failed
call goes at once), and :func:`end` clears it when the decoding loop ends, whatever way it ends,
so nothing of the call (its store, its ids) outlives it. No module
global, context variable or thread-local holds any of it: two threads' calls, or a call nested in
another (an assistant model's), each have their own record on their own cache.

What the call did stays readable on the cache it returns: ``cache.stats().reuse`` (the
:class:`~hf_vkv.cache.stats.ReuseReport`) and ``cache.stats().prefill_once``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..cache import VKVCache
from ..cache.stats import ReuseReport

if TYPE_CHECKING:
    from ..prefix import PrefixStore

__all__ = ["GenerateCall", "begin", "end", "reuse_report"]


@dataclass(slots=True, eq=False)
class GenerateCall:
    """One ``generate()`` call's state (see the module docstring).

    Invariants: ``cache.call is self`` from :func:`begin` to :func:`end` for the one cache it
    was put on; ``report is cache.reuse`` when there is a store; ``input_ids`` is set (and
    ``pads`` has a value per row) only once the prefill started rows from the store or chose a
    full prefill to store.
    """

    owned: bool  # the cache was made by generate's hook (closed when the call fails), not passed in
    rows: int  # rows of the prefill: batch x prompt_repeats
    prompt_repeats: int  # rows r*k .. r*k+k-1 repeat one prompt
    layout: str | None  # the cache's layout (devices.choose_layout), None until its first update
    num_beams: int = 1
    store: PrefixStore | None = None  # prefix reuse: where rows start from and finished rows go
    report: ReuseReport | None = None  # what reuse did (the cache's ``reuse``), None without a store
    eos: frozenset[int] = frozenset()  # end-of-sequence ids: a finished row is stored up to the first
    weights: str | None = None  # the model's weights fingerprint (checked against the store's)
    input_ids: torch.Tensor | None = None  # the prefill's [rows, T] ids, once reuse took the call
    pads: list[int] = field(default_factory=list)  # left padding of each row
    prefilled: bool = False  # the prefill hook ran (assisted decoding has none)
    taken: int = 0  # tokens of a store entry the cache took over (PrefixStore.take): given back if the call fails
    computed_before: int = 0  # the cache's prefill_counts.computed when the call began (a cache passed back has some)
    tokens: int | None = None  # tokens a row may cache in the call (max_length - 1, and prompt lookup's drafts)


def begin(cache: VKVCache, *, owned: bool, rows: int, num_beams: int = 1, store: PrefixStore | None = None,
          eos_token_id: Any = None, refusal: str | None = None, weights: str | None = None) -> GenerateCall:
    """Put a new record of a ``generate`` call of ``rows`` rows on ``cache`` (``store``: with
    prefix reuse, whose report starts with ``refusal`` when reuse cannot apply)."""
    eos = eos_token_id
    ids = frozenset([eos] if isinstance(eos, int) else [int(e) for e in (eos if eos is not None else [])])
    report = None if store is None else ReuseReport(refusal=refusal)
    call = GenerateCall(owned=owned, rows=rows, prompt_repeats=cache.prompt_repeats, layout=cache.layout,
                        num_beams=num_beams or 1, store=store, report=report, eos=ids, weights=weights,
                        computed_before=cache.prefill_counts.computed)
    cache.reuse = report if report is not None else cache.reuse
    cache.call = call
    return call


def end(cache: VKVCache) -> None:
    """The call using ``cache`` is over: its record leaves the cache (its ids and store with it)."""
    call, cache.call = cache.call, None
    if call is not None:
        call.input_ids = None


def reuse_report(result: Any) -> ReuseReport | None:
    """What prefix reuse did in the ``generate`` call that returned ``result`` (an output of
    ``return_dict_in_generate=True``, or the cache itself); ``None`` when that call had no prefix
    store, returned no cache (pass ``return_dict_in_generate=True``), or ran on a cache of
    transformers' own (a model whose layers keep no K/V vkv stores, or whose ``generate`` builds
    its own cache: the call's warning says so, and that the store went unused)."""
    cache = result
    if not isinstance(result, VKVCache):
        cache = next((getattr(result, name) for name in ("cache", "past_key_values")
                      if getattr(result, name, None) is not None), None)
        cache = getattr(cache, "self_attention_cache", cache)
    if not isinstance(cache, VKVCache):
        return None
    return None if cache.reuse is None else dataclasses.replace(cache.reuse)

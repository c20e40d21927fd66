"""A cache's record of ``generate``'s prefills of repeated prompts (prefill once).

:mod:`hf_vkv.prefill_once` asks :meth:`PrefillOnce.refusal` whether the next prefill may run once
per prompt, runs it inside :meth:`PrefillOnce.unique_prompts` (which repeats the rows afterwards,
pages shared), or records a prefill that ran on every row (:meth:`PrefillOnce.record_full`).
What they computed and saved, and the last verdict, are what :meth:`VKVCache.stats` reports.
The cache's rows and pages stay the cache's: this object reaches them through its public methods.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ..devices import policy_for
from ..memory.errors import InvariantError

if TYPE_CHECKING:
    from .cache import VKVCache

__all__ = ["PrefillOnce"]


class PrefillOnce:
    """The prefill-once bookkeeping of one :class:`~hf_vkv.VKVCache` (``cache.prefill``).

    * ``computed`` / ``saved``: prompt tokens ``generate``'s prefills computed, and spared by
      running each repeated prompt once;
    * ``verdict``: ``"on"``, or why the last prefill ran on every expanded row (or what it could
      not run once).
    """

    def __init__(self, cache: VKVCache) -> None:
        # weak: a cache's pages go back when its last reference does (no cycle for the collector)
        self._cache_ref = weakref.ref(cache)
        self.computed = 0
        self.saved = 0
        self.verdict = "no expanded prefill yet"

    def copy_for(self, cache: VKVCache) -> PrefillOnce:
        """The same record for ``cache`` (a fork: its counts start from this cache's)."""
        other = PrefillOnce(cache)
        other.computed, other.saved, other.verdict = self.computed, self.saved, self.verdict
        return other

    @property
    def _cache(self) -> VKVCache:
        cache = self._cache_ref()
        if cache is None:
            raise InvariantError("a cache's prefill-once record was used after the cache was freed")
        return cache

    def refusal(self, device: torch.device) -> str | None:
        """Why ``generate``'s next prefill on ``device`` must run on every expanded row (``None``:
        it may run once per prompt, see :meth:`unique_prompts`)."""
        cache = self._cache
        if cache.prompt_repeats < 2:
            return "no prompt is repeated"
        if not (cache.options.share_prompts and cache.options.prefill_once is not False):
            return "cache_config sets share_prompts or prefill_once to False"
        if cache.options.prefill_once is None and not policy_for(device).prefill_once:
            return (f"not measured exact on {device.type} yet: cache_config={{'prefill_once': True}} turns it on "
                    f"(a row of a batch-B forward may round differently from the same row in a batch-N one there)")
        if cache.get_seq_length() and not cache.rows_repeat_prompts():
            return "the cache already holds tokens, not the same ones in every row of a prompt"
        fixed = [type(layer).__name__ for layer in cache.transformers_layers()
                 if not hasattr(layer, "batch_repeat_interleave")]
        if fixed:
            return f"transformers' {fixed[0]} layers this cache keeps cannot repeat rows"
        return None

    def record_full(self, reason: str, *, rows: int, tokens: int) -> None:
        """``generate`` ran a prefill of ``rows`` rows x ``tokens`` tokens on every row, because of
        ``reason`` (``tokens``: the whole prompt; tokens the cache holds already, from stored
        prefixes, are not computed)."""
        self.computed += rows * (tokens - self._cache.get_seq_length())
        self.verdict = reason

    def note(self, detail: str) -> None:
        """What :meth:`VKVCache.stats` says of the last prefill once, where more than ``"on"``
        (calls of its forward that had to run on every expanded row, :mod:`hf_vkv.row_exactness`)."""
        self.verdict = detail

    @contextlib.contextmanager
    def unique_prompts(self, *, prompts: int, tokens: int,
                       repeat_rows: Callable[[int], None] | None = None) -> Iterator[None]:
        """Run ``generate``'s prefill on one row per prompt: inside, the cache takes ``prompts``
        distinct rows as they are (no prompt sharing among them); on success each row is then
        repeated :attr:`VKVCache.prompt_repeats` times (``repeat_rows``, default the cache's
        ``batch_repeat_interleave``; an encoder-decoder cache passes its own), its pages shared and
        nothing copied. Counts ``prompts x tokens`` computed and ``prompts x (k - 1) x tokens`` saved."""
        cache = self._cache
        k = cache.prompt_repeats
        past = cache.get_seq_length()
        if past:  # rows started from stored prefixes (take_rows), k per prompt on the same pages: keep one
            cache.batch_select_indices(range(0, cache.rows, k))
        tokens -= past
        with cache.prompts_alone():
            yield
        (repeat_rows or cache.batch_repeat_interleave)(k)
        cache.count_shared_prompt_rows(prompts * (k - 1))
        self.computed += prompts * tokens
        self.saved += prompts * (k - 1) * tokens
        self.verdict = "on"

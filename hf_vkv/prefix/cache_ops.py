"""What the prefix store needs from a :class:`~hf_vkv.VKVCache`, over the cache's public surface.

* :func:`rows` — the batch a cache holds;
* :func:`held_pages` — the physical pages (and private tensors) a cache holds, as set elements, so
  a union over several caches counts a page shared by forks once;
* :func:`min_reusable_length` — the shortest prefix a cache can be cut back to: sliding-window
  layers drop pages wholly behind their window, and a prefix of ``m`` tokens needs the window
  before ``m`` (tokens ``[m - window + 1, m)``) still mapped;
* :func:`fork_prefix` — a zero-copy fork cut back to its first ``m`` tokens.

A cache rebuilt from a file has placeholder (NaN) K/V before its window in sliding layers (see
``persist.py``): :func:`mark_reliable_from` records where real data starts, and forks made here
inherit the mark. (A ``VKVCache`` method that writes states at an offset would make the
placeholders, and this mark, unnecessary.)
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

from ..cache import VKVCache, VKVLayer

__all__ = ["rows", "held_pages", "min_reusable_length", "fork_prefix", "mark_reliable_from"]

# cache -> the shortest prefix it may be cut back to because of placeholder K/V (files only)
_RELIABLE_FROM: weakref.WeakKeyDictionary[VKVCache, int] = weakref.WeakKeyDictionary()


def rows(cache: VKVCache) -> int:
    """Rows (batch) the cache holds now."""
    groups = [g for g in cache.groups if g.buffer is not None]
    if groups:
        return max(g.batch for g in groups)
    keys = next((layer.keys for layer in cache.layers if getattr(layer, "keys", None) is not None), None)
    return 0 if keys is None else int(keys.shape[0])


def held_pages(cache: VKVCache) -> dict[Hashable, int]:
    """``{page: bytes}`` for every physical page the cache's layer groups hold (a page is
    ``(arena, page id)``: forks of one cache share an arena and their shared pages compare equal),
    plus the K/V tensors of layers kept outside the groups (transformers' own layers)."""
    out: dict[Hashable, int] = {}
    for group in cache.groups:
        buffer = group.buffer
        if buffer is None or buffer.closed:
            continue
        page_bytes = buffer.arena.page_bytes
        for row in buffer.table:
            for page in row.pages:
                out[(buffer.arena, int(page))] = page_bytes
    for layer in cache.layers:
        if not isinstance(layer, VKVLayer):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None:
                    out[("tensor", id(layer), t.data_ptr())] = t.numel() * t.element_size()
    return out


def min_reusable_length(cache: VKVCache) -> int:
    """The shortest prefix ``m`` that :func:`fork_prefix` can cut this cache back to (0: any).

    A sliding group whose first mapped token is ``f > 0`` serves ``m >= f + window - 1``; a layer
    kept outside the groups that slides (transformers' own) serves the whole cache only.
    """
    length = cache.get_seq_length()
    m = _RELIABLE_FROM.get(cache, 0)
    for group in cache.groups:
        buffer = group.buffer
        if group.sliding_window is None or buffer is None or buffer.closed or not buffer.length(0):
            continue
        first = buffer.first_live(0)
        if first > 0:
            m = max(m, first + group.sliding_window - 1)
    if any(getattr(layer, "is_sliding", False) and not isinstance(layer, VKVLayer) for layer in cache.layers):
        m = length
    return min(m, length)


def mark_reliable_from(cache: VKVCache, length: int) -> None:
    """Record that ``cache`` must not be cut back below ``length`` tokens (placeholder K/V)."""
    if length > _RELIABLE_FROM.get(cache, 0):
        _RELIABLE_FROM[cache] = length


def fork_prefix(cache: VKVCache, length: int) -> VKVCache:
    """A zero-copy fork of a batch-1 ``cache`` holding its first ``length`` tokens.

    The fork shares every page with ``cache``; a write into a shared page copies that page, so
    ``cache`` never changes through the fork. Cutting a sliding layer that has passed its window
    back needs ``activate_past_recording()`` on the fork (transformers' rule for ``crop``), so
    such a fork keeps its pages behind the window from then on.

    Raises:
        ValueError: ``length`` is not in ``[min_reusable_length(cache), get_seq_length()]``.
    """
    n = cache.get_seq_length()
    floor = min_reusable_length(cache)
    if not 0 < length <= n or length < floor:
        raise ValueError(
            f"cannot cut a cache of {n} tokens back to {length}: it serves prefixes of {max(floor, 1)}..{n} "
            f"tokens (sliding-window layers dropped the pages behind their window)"
        )
    fork = cache.fork()
    try:
        if length < n:
            for layer in fork.layers:
                window = getattr(layer, "sliding_window", None)
                if window is not None and layer.get_seq_length() >= window:
                    layer.activate_past_recording()
            fork.crop(length - n)  # a negative count: remove the last n - length tokens
    except BaseException:
        fork.close()
        raise
    if cache in _RELIABLE_FROM:
        mark_reliable_from(fork, _RELIABLE_FROM[cache])
    return fork

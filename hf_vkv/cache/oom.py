"""What a step of a layer group needs when the page budget cannot hold it.

``KVCacheOutOfMemory`` raised deep in a step names the allocation that failed: one sub-row's page
after the step's earlier allocations (rolled back since) took the free ones, so "needs 4,096
bytes, 0 free" while the step needed hundreds of pages and the budget had room for many. This
module counts, from the page tables alone (nothing is allocated), the pages the whole step of
the group needs, and :func:`step_out_of_memory` re-raises with that total, what is free now,
and a ``budget_bytes`` that would fit the step. Contiguous layouts (head-major, token-major) only:
the paged layout's block store and the static layout's pages mapped ahead are not restated yet.
"""

from __future__ import annotations

from ..memory import KVCacheOutOfMemory, VirtualBuffer

__all__ = ["STORE_BUDGET", "bytes_at_most", "pages_for_step", "step_out_of_memory"]


def pages_for_step(group: object, batch: int, start: int, end: int) -> int:
    """Pages ``group.prepare(batch, start, end)`` takes: growth of every written sub-row to
    ``end`` tokens plus a private copy of each shared page in ``[start, end)`` (at a prefill of
    expanded prompts only each prompt's first row is written; the others share its pages)."""
    buffer = group.buffer  # type: ignore[attr-defined]
    table, page, item = buffer.table, buffer.store.page_bytes, buffer.item_bytes
    pool = buffer.store.pool
    k = group.prompts.repeats  # type: ignore[attr-defined]
    shared_prefill = group.prompts.applies(batch=batch, start=start, end=end)  # type: ignore[attr-defined]
    rows = range(0, batch, k) if shared_prefill else range(min(batch, buffer.rows))
    need = 0
    for r in rows:
        for t in buffer.table_rows(r):
            row = table.row(t)
            if shared_prefill:  # truncated to 0 first: pages it holds now go back before the growth
                need += -(-end * item // page)
                continue
            need += max(0, -(-end * item // page) - row.end)
            first, last = start * item // page, (min(end * item, row.length) - 1) // page
            need += sum(1 for i in range(max(first, row.start), min(last + 1, row.end)) if pool.is_shared(row.page_at(i)))
    return need


def bytes_at_most(group: object, rows: int, tokens: int) -> int | None:
    """Bytes ``rows`` rows of ``group`` hold at most at ``tokens`` tokens each (a sliding window's
    at its reservation), no page shared: every sub-row's pages. 0 for a group with no buffer yet
    (no states: no size known); ``None`` for a closed one or another layout's than a contiguous
    one (the paged layout's blocks)."""
    buffer = getattr(group, "buffer", None)
    if buffer is None:
        return 0
    if not isinstance(buffer, VirtualBuffer) or buffer.closed:
        return None
    if getattr(group, "sliding_window", None) is not None:
        tokens = min(tokens, buffer.capacity)
    page = buffer.store.page_bytes
    return rows * len(buffer.table_rows(0)) * -(-tokens * buffer.item_bytes // page) * page


#: Where the budget of a cache drawing from a prefix store's memory is set (a call's own
#: ``cache_config['budget_bytes']`` beside a store is refused: its pages are the store's).
STORE_BUDGET = "the prefix store's memory budget, PrefixStore(model.config, cache_config={'budget_bytes': N}),"


def step_out_of_memory(group: object, batch: int, start: int, end: int, error: KVCacheOutOfMemory, *,
                       budget: str | None = None) -> KVCacheOutOfMemory:
    """``error`` restated for the whole step of ``group`` (rows ``0..batch-1``, tokens
    ``[start, end)``): its total need, the bytes free, and a budget that fits it (``budget``:
    where that budget is set, when not the call's ``cache_config``)."""
    buffer = getattr(group, "buffer", None)
    if not isinstance(buffer, VirtualBuffer) or buffer.closed:
        # the paged layout's blocks live in a block store that grows by pages of its own: its
        # error already counts those pages
        return error
    stats = buffer.store.pool.stats()
    page = stats.page_bytes
    need = pages_for_step(group, batch, start, end)
    free = max(stats.budget_pages - stats.in_use, 0)
    return error.for_whole_step(
        requested_bytes=need * page, free_bytes=free * page, budget_bytes=stats.budget_pages * page,
        what=f"this step of layer group {getattr(group, 'name', '?')!r} ({batch} row(s), tokens [{start}, {end}): "
             f"{need:,} pages of {page:,} bytes)", fits_bytes=(stats.in_use + need) * page, budget=budget)

"""The mapping budget: Linux allows a process ``vm.max_map_count`` memory mappings, vkv counts its own.

Every run of consecutive physical pages mapped into a reservation is one kernel mapping (a VMA),
and so is every stretch of reserved-but-unmapped slots between them; neighbours merge when the
kernel can (two unmapped stretches, or pages whose memfd offsets continue each other). A process
past ``vm.max_map_count`` (65530 by default) gets ``ENOMEM`` from ``mmap``, and a ``MAP_FIXED``
that fails half way may leave a hole in a reservation. So the host backend never goes there:

* :class:`MapBudget` knows the limit (read from ``/proc/sys/vm/max_map_count``, or injected),
  how many mappings vkv holds (its buffers charge and refund what they change), and how many the
  rest of the process holds (``/proc/self/maps`` less vkv's, re-read when vkv's count has moved by
  a quarter of the headroom, when a change does not fit, and when the count is older than
  :attr:`MapBudget.STALE_S`: a long-lived process that grows after vkv looked, a server loading
  another model, is seen within seconds), and leaves ``headroom`` for the process to grow.
  Listing ``/proc/self/maps`` costs the kernel ~1.5 ms for a PyTorch process's ~1,000 mappings,
  so the process's budget lets a new reservation (one mapping, nothing mapped in it yet) through
  until it has looked (:meth:`MapBudget.check_reservation`): a process's first prefix open
  reserves its arena's range and maps nothing, and the first change that maps pages looks;
* a buffer computes, before it changes any mapping, how many mappings its change needs at its peak
  (:func:`mapping_change`) and asks :meth:`MapBudget.check`, which raises
  :class:`MappingLimitError` (a :class:`~hf_vkv.memory.errors.KVCacheOutOfMemory`) with nothing
  changed.

The count is the kernel's merge rule applied to the page table, so it is exact for the layouts'
mappings (``tests/unit/test_map_budget.py`` compares it with ``/proc/self/maps``); the headroom
absorbs what it cannot see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from operator import sub
from time import monotonic

from .errors import KVCacheOutOfMemory
from .runs import is_one_run

__all__ = ["MapBudget", "MappingLimitError", "PROCESS_MAP_BUDGET", "SlotRun", "mapping_change", "process_mappings",
           "read_max_map_count"]

_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
_DEFAULT_LIMIT = 65530  # the kernel's default, when /proc cannot be read


def read_max_map_count() -> int:
    """``vm.max_map_count`` of this machine (the kernel's default 65530 if it cannot be read)."""
    try:
        with open(_MAX_MAP_COUNT) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return _DEFAULT_LIMIT


def process_mappings() -> int:
    """Mappings this process holds now: the lines of ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


class MappingLimitError(KVCacheOutOfMemory):
    """A change would take this process past ``vm.max_map_count``: raised before anything changed,
    so the cache stays usable (free rows, or build it with fewer mappings per row)."""

    def __init__(self, *, needed: int, held: int, limit: int, others: int, headroom: int,
                 store_layout: bool = False) -> None:
        self.needed, self.held, self.limit, self.others, self.headroom = needed, held, limit, others, headroom
        self.store_layout = store_layout  # the rows' layout was a prefix store's (rule 4 of choose_layout)
        # A prefix store's rows share its entries' pages, so they take the store's layout: the
        # token-major fix is the store's option, not the call's.
        token_major = ("a prefix store of the token-major layout (PrefixStore(model.config, cache_config="
                       "{'layout': 'token_major'}): its rows take the store's layout; one mapping per row instead "
                       "of one per layer and head)" if store_layout else
                       "the token-major layout (cache_config['layout']='token_major', one mapping per row instead "
                       "of one per layer and head)")
        super().__init__(  # counted in mappings, not bytes
            requested_bytes=0, free_bytes=0, budget_bytes=0,
            message=f"KV cache out of memory mappings: this step needs up to {needed:,} more, but vkv already holds "
                    f"{held:,} and vm.max_map_count is {limit:,} (the rest of the process holds {others:,}, and "
                    f"{headroom:,} are left free for it), so use fewer rows (batch, beams, num_return_sequences), "
                    f"larger pages (cache_config['page_bytes']) or {token_major}, "
                    f"or raise the limit (sudo sysctl -w vm.max_map_count=262144).")

    def for_whole_step(self, **_: object) -> MappingLimitError:
        """Itself: it counts the whole change's mappings already, and the page budget is not its limit."""
        return self

    for_whole_call = for_whole_step


class MapBudget:
    """Mappings vkv may hold in this process (see the module docstring).

    ``limit``: ``vm.max_map_count`` (read from ``/proc`` when ``None``); ``headroom``: mappings
    left for the rest of the process to grow into (default ``max(2048, limit // 8)``);
    ``lazy_reservations``: :meth:`check_reservation` lets a reservation through until the budget
    has looked at the process (else the first reservation looks).

    Invariant: ``held`` is the sum of what every live buffer charged and has not refunded.
    """

    #: Seconds after which the count of the rest of the process is read again at the next check:
    #: at most one ``/proc/self/maps`` listing per interval of mapping changes (~1.5 ms for a
    #: PyTorch process's ~1,000 mappings, ~1 us a line), and what the headroom must cover is what the
    #: rest of the process adds within it.
    STALE_S = 5.0

    def __init__(self, *, limit: int | None = None, headroom: int | None = None,
                 lazy_reservations: bool = False) -> None:
        self._limit = limit
        self._headroom = headroom
        self._lazy = lazy_reservations
        self.held = 0  # mappings vkv's live reservations hold (its count, not the kernel's)
        self._others: int | None = None  # the rest of the process, as last measured
        self._held_at_measure = 0
        self._measured_at = 0.0  # monotonic() of that measure

    @property
    def limit(self) -> int:
        if self._limit is None:
            self._limit = read_max_map_count()
        return self._limit

    @property
    def headroom(self) -> int:
        return self._headroom if self._headroom is not None else max(2048, self.limit // 8)

    def others(self, *, fresh: bool = False) -> int:
        """Mappings of the rest of the process (``/proc/self/maps`` less vkv's), re-read when
        ``fresh``, when vkv's count moved by more than a quarter of the headroom since, or when the
        count is older than :attr:`STALE_S` seconds."""
        now = monotonic()
        if fresh or self._others is None or abs(self.held - self._held_at_measure) > self.headroom // 4 \
                or now - self._measured_at > self.STALE_S:
            self._others = max(0, process_mappings() - self.held)
            self._held_at_measure, self._measured_at = self.held, now
        return self._others

    def available(self) -> int:
        """Mappings vkv may still add (may be negative when the process grew past the budget)."""
        return self.limit - self.headroom - self.others() - self.held

    def fits(self, needed: int) -> bool:
        """Whether ``needed`` more mappings fit beside the rest of the process as last measured
        (the first call measures it)."""
        return needed <= 0 or needed <= self.limit - self.headroom - self.held - self.others()

    def check(self, needed: int) -> None:
        """Raise :class:`MappingLimitError` unless ``needed`` more mappings fit (changes nothing)."""
        if self.fits(needed):
            return
        others = self.others(fresh=True)  # the process may have shrunk since the last look
        if self.held + needed > self.limit - self.headroom - others:
            raise MappingLimitError(needed=needed, held=self.held, limit=self.limit, others=others,
                                    headroom=self.headroom)

    def check_reservation(self) -> None:
        """:meth:`check` for a new reservation's one mapping; a ``lazy_reservations`` budget that
        has not looked at the process yet lets it through without a look (one mapping cannot take
        a process that was within its limit far past it; the first change that maps pages looks)."""
        if not (self._lazy and self._others is None):
            self.check(1)

    def charge(self, delta: int) -> None:
        """vkv now holds ``delta`` more mappings (negative: fewer)."""
        self.held += delta

    @contextmanager
    def override(self, *, limit: int | None = None, headroom: int | None = None) -> Iterator[MapBudget]:
        """Tests: use ``limit`` / ``headroom`` instead of the machine's for the ``with`` block (so a
        test reaches the limit with a few hundred mappings, not 65530); the budget looks at the
        process's mappings at the first check, a reservation's included."""
        saved = (self._limit, self._headroom, self._others, self._lazy, self._held_at_measure, self._measured_at)
        self._limit, self._headroom, self._others, self._lazy = limit, headroom, None, False
        try:
            yield self
        finally:
            (self._limit, self._headroom, self._others, self._lazy, self._held_at_measure,
             self._measured_at) = saved


#: The process's budget (``vm.max_map_count`` is per process): every host buffer charges it.
PROCESS_MAP_BUDGET = MapBudget(lazy_reservations=True)

Slot = Callable[[int], "int | None"]  # global slot -> page id mapped there (None: reserved, unmapped)

#: A run of page slots that changes: ``(first global slot, pages before, pages after)`` (None: unmapped).
SlotRun = tuple[int, Sequence["int | None"], Sequence["int | None"]]


def _joined(x: int | None, y: int | None) -> bool:
    """Whether neighbouring slots holding ``x`` then ``y`` are one mapping."""
    return (x is None and y is None) or (x is not None and y is not None and y == x + 1)


def _inner_breaks(pages: Sequence[int | None]) -> int:
    """Mapping boundaries between neighbouring slots of ``pages``. A run of consecutive ids or of
    unmapped slots (what rows hold and what a share maps: the common case) is found by one
    comparison, not a loop per slot."""
    n = len(pages)
    if n < 2:
        return 0
    a, b = pages[0], pages[-1]
    if a is None:
        if b is None and pages.count(None) == n:
            return 0
    elif b is not None and is_one_run(pages):  # a None inside makes the lists differ
        return 0
    if None not in pages:  # mapped slots only (a row's pages): count the steps that are not +1, in C
        return n - 1 - list(map(sub, pages[1:], pages[:-1])).count(1)
    return sum(1 for x, y in zip(pages, pages[1:]) if not _joined(x, y))


def mapping_change(runs: Iterable[SlotRun], old: Slot, total: int) -> tuple[int, int]:
    """``(peak, final)`` change in the mappings of a reservation of ``total`` page slots when the
    disjoint slot ``runs`` (in the order they are applied) go from their pages before to their
    pages after; ``old(g)``: the page at slot ``g`` before any run is applied (asked only next to
    a run's ends). Two neighbouring slots are one mapping when both are unmapped or hold
    consecutive pages; the peak adds 2 for the moment inside a run when only part is applied."""
    ends: dict[int, int | None] = {}  # the first and last slot of each run applied -> its page after
    delta = peak = 0
    for first, before, after in runs:
        n = len(after)
        if not n:
            continue
        last = first + n - 1
        a, z, b, y = after[0], after[-1], before[0], before[-1]
        if type(after) is range and after.step == 1 and b is None and (n == 1 or before.count(None) == n):
            change = 0  # one run of pages into unmapped slots (a row that grows, a share, a repeat): no inner break
        else:
            change = _inner_breaks(after) - _inner_breaks(before)
        if first >= 1:
            left = ends[first - 1] if first - 1 in ends else old(first - 1)
            change += _joined(left, b) - _joined(left, a)
        if last + 1 < total:
            right = ends[last + 1] if last + 1 in ends else old(last + 1)
            change += _joined(y, right) - _joined(z, right)
        ends[first], ends[last] = a, z
        delta += change
        if delta + 2 > peak:
            peak = delta + 2
    return peak, delta

"""The mapping budget (``vm.max_map_count``): vkv's count of its kernel mappings is the kernel's,
and a change that would not fit is refused before anything changes.

The limit is injected (``PROCESS_MAP_BUDGET.override``): the tests reach it with a few hundred
mappings, never the machine's 65530 (other processes share the machine).
"""

from __future__ import annotations

import random

import pytest

from hf_vkv.memory import Arena, HostBackend, SubRowBuffer, VirtualBuffer
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError, mapping_change, process_mappings

PAGE = 4096


def kernel_mappings(buf: VirtualBuffer) -> int:
    """Lines of /proc/self/maps inside ``buf``'s reservation (the kernel's count)."""
    lo, hi = buf.address, buf.address + buf.table.rows * buf.row_stride
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            n += start < hi and end > lo
    return n


def _runs(old, new, spans):
    return [(a, old[a:a + n], new[a:a + n]) for a, n in spans]


def test_mapping_change_counts_runs_and_merges():
    # 6 slots: [None, None, 5, 6, None, None] -> one mapping of 2 pages in the middle: 3 mappings
    old = [None] * 6
    new = [None, None, 5, 6, None, None]
    peak, final = mapping_change(_runs(old, new, [(2, 2)]), old.__getitem__, 6)
    assert final == 2 and peak == 4  # the bound: checked against the kernel's count below
    # pages that do not continue each other are two mappings
    new2 = [None, None, 5, 9, None, None]
    assert mapping_change(_runs(old, new2, [(2, 2)]), old.__getitem__, 6)[1] == 3
    # unmapping everything gives the mappings back
    assert mapping_change(_runs(new, old, [(2, 2)]), new.__getitem__, 6)[1] == -2


def _mappings(slots):
    """The kernel's count, slot by slot: 1 + the boundaries between neighbours that do not merge."""
    return 1 + sum(1 for x, y in zip(slots, slots[1:])
                   if not ((x is None and y is None) or (x is not None and y is not None and y == x + 1)))


def test_mapping_change_equals_the_slot_by_slot_count():
    """Runs of consecutive pages (one comparison), of unmapped slots, mixed runs, runs next to each
    other and at both ends of the reservation: the final change is the slot-by-slot count's, the
    peak the largest running change + 2."""
    rng = random.Random(7)
    for _ in range(400):
        total = rng.randint(1, 24)
        old = [rng.choice([None, None, rng.randint(0, 40)]) for _ in range(total)]
        cuts = sorted(rng.sample(range(total + 1), rng.randint(2, min(6, total + 1))))
        spans = [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a and rng.random() < 0.7]
        rng.shuffle(spans)
        new = list(old)
        for a, n in spans:
            kind = rng.random()
            base = rng.randint(0, 40)
            for k in range(n):
                new[a + k] = None if kind < 0.3 else base + k if kind < 0.7 else rng.choice([None, rng.randint(0, 40)])
        state, running, peak = list(old), 0, 0
        for a, n in spans:
            before = _mappings(state)
            state[a:a + n] = new[a:a + n]
            running += _mappings(state) - before
            peak = max(peak, running + 2)
        assert mapping_change(_runs(old, new, spans), old.__getitem__, total) == (peak, running), (old, new, spans)
        # as the buffers give them: a run of consecutive pages as a range (into unmapped slots: counted without a loop)
        ranged = [(a, before, range(after[0], after[0] + len(after)))
                  if None not in after and list(after) == list(range(after[0], after[0] + len(after))) else (a, before, after)
                  for a, before, after in _runs(old, new, spans)]
        assert mapping_change(ranged, old.__getitem__, total) == (peak, running), (old, new, spans)


OPS = [
    ("grow", lambda b: b.grow([0, 1, 2], 300)),
    ("grow more", lambda b: b.grow([0, 3], 500)),
    ("share", lambda b: b.share(0, [2], length=200)),
    ("prepare_write (CoW)", lambda b: b.prepare_write([2], 150, 260)),
    ("reorder", lambda b: b.reorder([1, 0, 0, 3])),
    ("drop_before", lambda b: b.drop_before([0, 1], 120)),
    ("truncate", lambda b: b.truncate([2, 3], 90)),
    ("clear", lambda b: b.clear([1])),
    ("repeat (one row's very tables in every row)", lambda b: b.reorder([0, 0, 0, 0])),
]


@pytest.mark.parametrize("kind", ["rows", "sub-rows", "readable"])
def test_the_count_is_the_kernels(kind):
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-budget"))
    if kind == "sub-rows":
        buf = SubRowBuffer(arena, rows=4, blocks=2, heads=3, capacity=600, item_bytes=32)
    else:
        buf = VirtualBuffer(arena, rows=4, capacity=600, item_bytes=32, readable=kind == "readable")
    held = PROCESS_MAP_BUDGET.held
    assert buf._reservation.mappings == kernel_mappings(buf) == 1
    for name, op in OPS:
        op(buf)
        assert buf._reservation.mappings == kernel_mappings(buf), name
        buf.check_invariants()
    assert PROCESS_MAP_BUDGET.held - held == buf._reservation.mappings - 1
    buf.close()
    del buf
    assert PROCESS_MAP_BUDGET.held == held - 1  # the reservation's own mapping went with it


@pytest.mark.parametrize("kind", ["rows", "sub-rows"])
def test_the_peak_bounds_what_the_kernel_counts_during_each_change(kind, monkeypatch):
    """The peak a change is checked against (``mapping_change``'s) is at least the most mappings
    the kernel holds at any moment of it: counted in ``/proc/self/maps`` after every ``mmap`` the
    host backend makes while the change is applied (each syscall is one step the kernel sees)."""
    import hf_vkv.memory.host_backend as host
    import hf_vkv.memory.virtual_buffer as vb

    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-budget"))
    buf = SubRowBuffer(arena, rows=4, blocks=2, heads=3, capacity=600, item_bytes=32) if kind == "sub-rows" \
        else VirtualBuffer(arena, rows=4, capacity=600, item_bytes=32)
    changes: list[dict] = []  # per change: its computed (peak, final), the kernel's counts after each syscall

    def counted_change(*args):
        peak, final = mapping_change(*args)
        changes.append({"peak": peak, "final": final, "before": kernel_mappings(buf), "seen": []})
        return peak, final

    real_mmap = host._mmap

    def counted_mmap(*args):
        out = real_mmap(*args)
        if changes:
            changes[-1]["seen"].append(kernel_mappings(buf))
        return out

    monkeypatch.setattr(vb, "mapping_change", counted_change)
    monkeypatch.setattr(host, "_mmap", counted_mmap)
    for name, op in OPS:
        op(buf)
    assert len(changes) >= len(OPS) - 1 and sum(len(c["seen"]) for c in changes) > len(changes)
    for c in changes:
        deltas = [n - c["before"] for n in c["seen"]]
        assert deltas and deltas[-1] == c["final"], c
        assert max(deltas) <= c["peak"], c
    buf.close()


def test_a_change_past_the_limit_is_refused_before_anything_changes(buffer_snapshot, mapped_pages):
    buf = SubRowBuffer(Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-budget")), rows=8, blocks=4,
                       heads=4, capacity=640, item_bytes=64)  # 128 sub-rows of 10 pages: a row growing by one page adds 32
    buf.grow([0], 10)
    others = process_mappings() - PROCESS_MAP_BUDGET.held
    with PROCESS_MAP_BUDGET.override(limit=PROCESS_MAP_BUDGET.held + others + 40, headroom=0):
        buf.grow([1], 10)  # fits
        before = buffer_snapshot(buf)
        with pytest.raises(MappingLimitError) as info:
            buf.grow([2, 3], 10)
        message = str(info.value)
        assert "vm.max_map_count" in message and "token_major" in message and "sysctl" in message
        assert message.count(".") <= 6 and "\n" not in message and info.value.__cause__ is None
        assert info.value.needed > 40 - 32 and isinstance(info.value, MemoryError)
        assert buffer_snapshot(buf) == before
        buf.check_invariants()
        mapped_pages(buf)
        buf.clear([0, 1])  # freeing rows gives mappings back: the same call now fits
        buf.grow([2, 3], 10)
        mapped_pages(buf)
    buf.close()


def test_a_new_reservation_past_the_limit_is_refused():
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-budget"))
    first = VirtualBuffer(arena, rows=1, capacity=10, item_bytes=8)
    with PROCESS_MAP_BUDGET.override(limit=process_mappings(), headroom=0):
        with pytest.raises(MappingLimitError):
            VirtualBuffer(arena, rows=1, capacity=10, item_bytes=8)
    assert not arena.closed
    first.close()


def test_the_error_is_an_out_of_memory_error_built_by_its_base():
    """``MappingLimitError`` is constructed through ``KVCacheOutOfMemory`` (no field or message
    skipped), and restating it for a whole step leaves it as it is: it counts mappings, not pages."""
    from hf_vkv.memory import KVCacheOutOfMemory

    error = MappingLimitError(needed=10, held=90, limit=100, others=5, headroom=2)
    assert isinstance(error, KVCacheOutOfMemory) and isinstance(error, MemoryError)
    assert error.requested_bytes == error.free_bytes == error.budget_bytes == 0 and error.fits_bytes is None
    assert str(error).startswith("KV cache out of memory mappings: this step needs up to 10 more")
    assert error.for_whole_step(requested_bytes=1, free_bytes=0, budget_bytes=1, what="x", fits_bytes=2) is error
    pages = KVCacheOutOfMemory(requested_bytes=4096, free_bytes=0, budget_bytes=8192)
    whole = pages.for_whole_step(requested_bytes=40960, free_bytes=0, budget_bytes=8192, what="this step",
                                 fits_bytes=49152)
    assert type(whole) is KVCacheOutOfMemory and whole.requested_bytes == 40960 and whole.fits_bytes == 49152
    assert "this step need 40,960 bytes" in str(whole) and "at least 49,152" in str(whole)


def test_a_reservation_is_let_through_until_the_first_change_that_maps_pages_looks(monkeypatch):
    """Listing ``/proc/self/maps`` costs the kernel ~1.5 ms, so the process's budget lets a new
    reservation (one mapping, nothing mapped in it: a process's first prefix open) through
    without a look; the first change that maps pages looks, and from then on reservations and
    changes are decided by what it measured. An eager budget and the tests' override look at once."""
    from hf_vkv.memory import map_budget

    looks = []
    monkeypatch.setattr(map_budget, "process_mappings", lambda: looks.append(1) or 30_000 + budget.held)
    budget = map_budget.MapBudget(limit=65530, headroom=8191, lazy_reservations=True)
    for _ in range(3):
        budget.check_reservation()
        budget.charge(1)
    assert looks == []
    room = 65530 - 8191 - 30_000 - 3
    budget.check(room)  # the first change looks: 30,000 others
    assert looks == [1] and budget.fits(room) and not budget.fits(room + 1)
    with pytest.raises(MappingLimitError) as refused:
        budget.check(room + 1)
    assert refused.value.others == 30_000 and len(looks) == 2  # (a refusal looks again: the process may have shrunk)
    budget.charge(room)
    with pytest.raises(MappingLimitError):  # measured now: a reservation past the limit is refused
        budget.check_reservation()
    assert len(looks) == 4  # (vkv's count moved by more than a quarter of the headroom: a look, then the refusal's)
    monkeypatch.setattr(map_budget, "process_mappings", lambda: looks.append(1) or 1000)
    eager = map_budget.MapBudget(limit=65530, headroom=8191)  # not lazy: the first reservation looks
    eager.check_reservation()
    assert len(looks) == 5
    with map_budget.PROCESS_MAP_BUDGET.override(limit=65530, headroom=0):  # tests' limits: always looked at
        map_budget.PROCESS_MAP_BUDGET.check_reservation()
    assert len(looks) == 6


def test_a_count_older_than_stale_s_is_read_again_at_the_next_check(monkeypatch):
    """The rest of a long-lived process may grow after the budget looked (a server that loads
    another model) while vkv's own count stays where it was: a check more than
    :attr:`MapBudget.STALE_S` seconds after the last look reads ``/proc/self/maps`` again, so the
    change is decided on what the process holds now and refused with :class:`MappingLimitError`
    (not left to ``mmap``'s ``ENOMEM`` at the kernel's limit); within the interval no look is made."""
    from hf_vkv.memory import map_budget

    now, others, looks = [100.0], [1_000], []
    monkeypatch.setattr(map_budget, "monotonic", lambda: now[0])
    monkeypatch.setattr(map_budget, "process_mappings", lambda: looks.append(now[0]) or others[0] + budget.held)
    budget = map_budget.MapBudget(limit=65530, headroom=8191)
    budget.check(100)
    budget.charge(100)
    assert looks == [100.0]
    others[0] = 55_000  # the process grows past what the budget last saw
    now[0] += budget.STALE_S / 2
    budget.check(500)  # decided on the count of the look before: no look within the interval
    assert looks == [100.0]
    now[0] += budget.STALE_S
    with pytest.raises(MappingLimitError) as refused:
        budget.check(2_500)  # 55,000 + 100 + 2,500 > 65,530 - 8,191
    assert refused.value.others == 55_000 and len(looks) >= 2
    assert budget.fits(2_000) and not budget.fits(2_300)  # and from then on on the new count
    with budget.override(limit=70_000, headroom=0):  # an override's looks do not leave a count behind
        now[0] += 1
        budget.check(1)
    assert budget.others() == 55_000 and budget.limit == 65530

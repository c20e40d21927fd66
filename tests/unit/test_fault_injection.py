"""A backend call that fails in the middle of an operation leaves no trace.

For every operation, a dry run counts the backend calls it makes; then, on one buffer, each of
those calls is made to fail in turn (and each multi-page ``map`` also half-done, as a real ``map``
of several runs can be). After every failure the page tables, the pool (stats, in-use and
resident-free ids, refcounts), the kernel's mappings and every readable byte must be exactly as
before, and finally the same operation must succeed on that same buffer with the same result as
on a buffer that never failed.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from hf_vkv.memory import Arena, BackendError, VirtualBuffer

PAGE, ITEM, CAP = 4096, 24, 700


def setup(faulty_backend) -> VirtualBuffer:
    """Four rows in varied states: full, a shared prefix, private and windowed, empty."""
    buf = VirtualBuffer(Arena(faulty_backend(page_bytes=PAGE, name="hf_vkv-test-faults")), rows=4,
                        capacity=CAP, item_bytes=ITEM)
    gen = torch.Generator().manual_seed(0)
    for row, end in ((0, 600), (2, 400)):
        buf.prepare_write([row], 0, end)
        buf.view(range(row, row + 1), 0, end)[0] = torch.randint(0, 256, (end * ITEM,), dtype=torch.uint8,
                                                                 generator=gen)
    buf.share(0, [1], length=300)
    buf.drop_before([2], 180)
    return buf


def write(buf: VirtualBuffer, rows: list[int], start: int, end: int) -> None:
    buf.prepare_write(rows, start, end)
    for r in rows:
        buf.view(range(r, r + 1), start, end)[0] = r + 1


OPERATIONS: dict[str, Callable[[VirtualBuffer], object]] = {
    "grow": lambda b: b.grow([3, 1, 0, 2], 690),
    "prepare_write": lambda b: b.prepare_write([1, 0, 3], 100, 500),
    "share": lambda b: b.share(0, [3, 2, 1]),
    "share_prefix": lambda b: b.share(2, [0, 3], length=350),
    "reorder": lambda b: b.reorder([2, 2, 0, 0]),
    "reorder_shorter": lambda b: b.reorder([1, 0]),
    "truncate": lambda b: b.truncate([0, 2, 1], 100),
    "drop_before": lambda b: b.drop_before([0, 1, 2], 350),
    "clear": lambda b: b.clear([2, 0]),
    "fork": lambda b: b.fork(),
}


def final_bytes(buf: VirtualBuffer, result: object) -> list:
    bufs = [buf] + ([result] if isinstance(result, VirtualBuffer) else [])
    return [[(b.first_live(r), b.length(r), b.view(range(r, r + 1), b.first_live(r), b.length(r)).clone())
             for r in range(b.rows)] for b in bufs]


def same(a: list, b: list) -> bool:
    return all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for p, q in zip(a, b) for x, y in zip(p, q))


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_a_failed_backend_call_leaves_everything_as_it_was(name, faulty_backend, buffer_snapshot, mapped_pages):
    op = OPERATIONS[name]
    # Dry run: how many calls of each kind the operation makes, and what it must end with.
    reference = setup(faulty_backend)
    calls_before = dict(reference.store.backend.calls)
    expected = op(reference)
    calls = {m: reference.store.backend.calls[m] - calls_before[m] for m in calls_before}
    expected_bytes = final_bytes(reference, expected)
    assert sum(calls.values()) > 0

    buf = setup(faulty_backend)
    backend = buf.store.backend
    failures = 0
    for method, count in calls.items():
        for n in range(1, count + 1):
            for partial in (False, True):
                before = buffer_snapshot(buf, id_space=name != "fork")
                backend.arm(method, n, partial=partial)
                with pytest.raises(BackendError, match="injected failure"):
                    op(buf)
                assert not backend.disarm(), f"{method} call {n} was never made"
                failures += 1
                assert buffer_snapshot(buf, id_space=name != "fork") == before, (method, n, partial)
                buf.check_invariants()
                mapped_pages(buf)
    assert failures == 2 * sum(calls.values())

    result = op(buf)  # the buffer is still usable: the same call now succeeds
    buf.check_invariants()
    mapped_pages(buf)
    assert same(final_bytes(buf, result), expected_bytes)
    if isinstance(result, VirtualBuffer):
        mapped_pages(result)
        result.close()
    buf.close()
    if isinstance(expected, VirtualBuffer):
        expected.close()
    reference.close()
    assert buf.store.closed and backend.resident_bytes_at_close == 0  # failed forks did not keep it open


def test_operations_make_the_backend_calls_the_tests_count_on(faulty_backend):
    """The parametrized test above is only as strong as the calls it can fail: check they exist."""
    made = {}
    for name, op in OPERATIONS.items():
        buf = setup(faulty_backend)
        before = dict(buf.store.backend.calls)
        result = op(buf)
        made[name] = {m: n - before[m] for m, n in buf.store.backend.calls.items() if n > before[m]}
        if isinstance(result, VirtualBuffer):
            result.close()
        buf.close()
    assert made == {
        "grow": {"create": 1, "map": 4},
        "prepare_write": {"create": 1, "copy": 1, "map": 2},  # one create for row 1's grow + CoW (the one copy) and row 3's grow
        "share": {"map": 3},
        "share_prefix": {"map": 2, "unmap": 2},
        "reorder": {"map": 4, "unmap": 3},
        "reorder_shorter": {"map": 1, "unmap": 2},
        "truncate": {"unmap": 3},
        "drop_before": {"unmap": 3},
        "clear": {"unmap": 2},
        "fork": {"map": 3},
    }


def test_a_failed_fork_leaves_no_half_open_buffer(faulty_backend):
    buf = setup(faulty_backend)
    buf.store.backend.arm("map", 2)
    with pytest.raises(BackendError) as info:  # the traceback keeps fork()'s frames alive
        buf.fork()
    assert buf.store.pool.stats().in_use == 6  # the fork's references were rolled back
    buf.close()
    assert buf.store.closed  # the half-made fork was closed: it does not hold the arena open
    assert buf.store.backend.resident_bytes_at_close == 0
    del info
    gc.collect()


def test_close_returns_every_page_even_if_an_unmap_fails(faulty_backend):
    buf = setup(faulty_backend)
    backend = buf.store.backend
    backend.arm("unmap", 1)
    with pytest.raises(BackendError, match="injected failure"):
        buf.close()
    assert buf.closed and buf.store.closed
    assert buf.store.pool.stats().in_use == 0 and backend.resident_bytes_at_close == 0

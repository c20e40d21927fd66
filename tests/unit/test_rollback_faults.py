"""Map, unmap and the rollback itself fail at every point of a run: the process survives, each
buffer is intact (exactly as before) or closed, no reservation ever has a hole, and vkv maps
nothing outside its reservations.

Failures are injected at the system-call level (``host_backend._mmap``), so the host backend's
own recovery (re-reserving after a failed ``MAP_FIXED``) is under test too. A failing call may
also *leave a hole* first (it unmaps the range, as a kernel's failed ``MAP_FIXED`` can): the test
then checks that the hole never survives the error. Every failing call is followed by a second
one ``d`` calls later, so that the rollback's calls, the re-reserve and the whole-range reset
fail as well.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_vkv.memory import Arena, BackendError, HostBackend, SubRowBuffer, VirtualBuffer, VKVError
from hf_vkv.memory import host_backend as hb

PAGE, NAME = 4096, "hf_vkv-test-rollback"
MAP_FIXED = 0x10


class Faults:
    """Fails chosen ``MAP_FIXED`` calls of ``_mmap`` (1-based over the calls made while armed)."""

    def __init__(self, real) -> None:
        self.real, self.calls, self.fail_at, self.hole = real, 0, set(), False

    def __call__(self, address, nbytes, prot, flags, fd, offset):
        if address is not None and flags & MAP_FIXED:
            self.calls += 1
            if self.calls in self.fail_at:
                if self.hole:  # what a failed MAP_FIXED may leave behind
                    hb._munmap(address, nbytes)
                raise BackendError("mmap", "injected failure")
        return self.real(address, nbytes, prot, flags, fd, offset)


def setup(kind: str) -> VirtualBuffer:
    arena = Arena(HostBackend(page_bytes=PAGE, name=NAME))
    if kind == "sub-rows":
        buf = SubRowBuffer(arena, rows=3, blocks=2, heads=2, capacity=200, item_bytes=64)
    else:
        buf = VirtualBuffer(arena, rows=4, capacity=700, item_bytes=24)
    gen = torch.Generator().manual_seed(0)
    for row, end in ((0, 190), (1, 120)):
        buf.prepare_write([row], 0, end)
        data = buf.view(range(row, row + 1), 0, end)
        data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=gen))
    buf.share(0, [2], length=100)
    return buf


OPS = {
    "grow": lambda b: b.grow(range(b.rows), 199),
    "prepare_write": lambda b: b.prepare_write([2, 0], 50, 150),
    "reorder": lambda b: b.reorder([1, 0, 0][: b.rows]),
    "reorder_private_tails": lambda b: b.reorder([1, 0, 0][: b.rows], private_tails=True),
    "share": lambda b: b.share(1, [0, 2]),
    "truncate": lambda b: b.truncate([0, 1], 30),
    "drop_before": lambda b: b.drop_before([0, 2], 180),
    "fork": lambda b: b.fork(),
}


def maps() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, " ".join(fields[1:2] + fields[5:])))
    return out


def check_no_hole_no_stray(backend: HostBackend) -> None:
    """Every reservation is covered wholly by its own mappings (no hole), and the memfd is mapped
    nowhere but inside a reservation (or the backend's pool view)."""
    lines = maps()
    reservations = dict(backend._reservations)
    allowed = list(reservations.items())
    if backend._pool_view is not None:
        allowed.append((backend._pool_view[0].address, backend._pool_view[0].nbytes))
    for start, end, what in lines:
        if f"/memfd:{NAME}" in what:
            assert any(a <= start and end <= a + n for a, n in allowed), f"memfd mapped outside: {what}"
    for a, n in reservations.items():
        pos = a
        for start, end, what in sorted(lines):
            if end <= pos or start >= a + n:
                continue
            assert start <= pos, f"hole at {pos:#x} in the reservation at {a:#x}"
            assert what.split()[0] in ("---p", "rw-p", "rw-s"), what
            pos = end
            if pos >= a + n:
                break
        assert pos >= a + n, f"hole at {pos:#x} in the reservation at {a:#x}"


@pytest.mark.parametrize("kind", ["rows", "sub-rows"])
@pytest.mark.parametrize("name", list(OPS))
def test_failures_at_every_point_including_the_rollback(name, kind, monkeypatch, buffer_snapshot, mapped_pages):
    op = OPS[name]
    faults = Faults(hb._mmap)
    monkeypatch.setattr(hb, "_mmap", faults)
    dry = setup(kind)
    faults.calls = 0
    result = op(dry)
    count = faults.calls
    assert count > 0
    if isinstance(result, VirtualBuffer):
        result.close()
    dry.close()

    outcomes = {"intact": 0, "closed": 0, "rollback failed": 0}
    for n in range(1, count + 1):
        for d in (None, 1, 2, 4):
            for hole in (False, True):
                buf = setup(kind)
                backend = buf.store.backend
                before = buffer_snapshot(buf, id_space=name != "fork")
                faults.calls, faults.hole = 0, hole
                faults.fail_at = {n} if d is None else {n, n + d}
                with pytest.raises(VKVError) as info:
                    op(buf)
                faults.fail_at = set()
                message = str(info.value)
                assert "injected failure" in message and "\n" not in message
                assert message.count("failed") <= 2, message  # one sentence, never a nested chain
                check_no_hole_no_stray(backend)
                if "create a new cache" in message:
                    outcomes["rollback failed"] += 1
                if buf.closed:
                    outcomes["closed"] += 1
                    assert "create a new cache" in message
                else:
                    outcomes["intact"] += 1
                    assert buffer_snapshot(buf, id_space=name != "fork") == before, (n, d, hole)
                    buf.check_invariants()
                    mapped_pages(buf)
                    assert isinstance(op(buf), (VirtualBuffer, bool, type(None)))  # still usable
                    mapped_pages(buf)
                buf.close()
                del info
                assert buf.store.closed
    del buf
    gc.collect()
    assert not backend._reservations  # every reservation was given back
    # both ends of the contract were reached (a failed fork closes the fork, not the original)
    assert outcomes["intact"] and outcomes["rollback failed"] and (outcomes["closed"] or name == "fork")

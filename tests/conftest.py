"""Fixtures shared by every tier of the suite (``unit/``, ``stateful/``, ``integration/``,
``system/``, ``gpu/``).

* ``intra_op_threads`` (autouse): one torch intra-op thread during each test, or each count of
  ``@pytest.mark.threads(...)`` in turn;
* ``layout``: a :class:`models.LayoutRun` per VKV layout (a test, or a module through
  ``pytest.mark.usefixtures("layout")``, runs once in each);
* ``faulty_backend``: a :class:`FaultyBackend` factory, a host backend that fails a chosen call;
* ``mapped_pages``: asserts the kernel (``/proc/self/maps``) maps exactly what page tables say;
* ``buffer_snapshot``: everything a failed operation must leave exactly as it was;
* ``rss``: resident bytes of an address range as RSS counts them (an aliased page once per mapping);
* :func:`assert_owner_lives_with_views` (a function): the DLPack lifetime rule of the CUDA backend's tensors.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

# Row-exactness proofs stay in each test process: a test's verdicts never come from an earlier run's
# file (tests of the proof file name their own, hf_vkv.generate.proof_file).
os.environ["HF_VKV_PROOF_CACHE"] = "off"

from hf_vkv.memory import BackendError, HostBackend, PageId, VirtualBuffer

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:  # the shared helpers (models.py) for the tiers in sub-folders
    sys.path.append(_TESTS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.threads(1, 2)`` runs a test once per intra-op thread count (ids ``1thr``, ``2thr``)."""
    marker = metafunc.definition.get_closest_marker("threads")
    if marker is not None:
        metafunc.parametrize("intra_op_threads", marker.args, ids=[f"{n}thr" for n in marker.args], indirect=True)


@pytest.fixture(autouse=True)
def intra_op_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The torch intra-op threads during each test: 1 unless the test is marked
    ``threads(...)`` (then each count in turn). One by default because the tiny models and pools
    gain nothing from more, and on a busy 2-core machine a second OpenMP thread waiting for a
    descheduled peer made runs 10-50x slower (SmolLM2's 8 x 1024-token prefill: 200 s with 2
    threads, 70 s with 1, while another process kept one core busy). Exactness must not rest on
    it: every test of prefill once, beams, sampling and the cascade is marked ``threads(1, 2)``
    (users run torch with all their cores)."""
    threads = getattr(request, "param", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=("token_major", "head_major", "paged"))
def layout(request: pytest.FixtureRequest):
    """The VKV layout of this case, as a :class:`models.LayoutRun` (its A/B helpers run it)."""
    from models import LAYOUTS, LayoutRun  # imports transformers: only tests that ask for a layout pay

    assert request.param in LAYOUTS
    return LayoutRun(request.param)


class FaultyBackend:
    """A :class:`HostBackend` that fails the ``fail_at``-th call to one of its methods.

    :meth:`arm` picks the method and the call (1 = the next one); the failing call raises
    :class:`BackendError` without doing anything, or, with ``partial=True`` and a ``map`` of several
    pages, after mapping the first half of them (as a real ``map`` of several runs can). Every call
    is counted in ``calls``, so a dry run tells how many calls an operation makes. ``inner``
    replaces the host backend it wraps (the GPU suite wraps a CUDA backend).
    """

    FAULTABLE = ("create", "map", "unmap", "copy")

    def __init__(self, *, page_bytes: int, name: str = "hf_vkv-test", inner: object | None = None) -> None:
        self.inner = inner if inner is not None else HostBackend(page_bytes=page_bytes, name=name)
        self.name = name  # the memfd shows in /proc/self/maps as /memfd:<name>
        self.page_bytes = self.inner.page_bytes
        self.device = self.inner.device
        self.gathered_copies = getattr(self.inner, "gathered_copies", False)  # copy() is the inner one's
        self.calls = dict.fromkeys(self.FAULTABLE, 0)
        self.failures = 0
        self.resident_bytes_at_close: int | None = None
        self._armed: tuple[str, int, bool] | None = None
        self._also: tuple[str, int] | None = None

    def arm(self, method: str, fail_at: int, *, partial: bool = False) -> None:
        assert method in self.FAULTABLE and fail_at >= 1
        self._armed = (method, self.calls[method] + fail_at, partial)

    def arm_also(self, method: str, fail_at: int) -> None:
        """A second failure, of the ``fail_at``-th call of ``method`` from now (another method's
        than :meth:`arm`'s, or a later call of the same): it hits a rollback's calls."""
        assert method in self.FAULTABLE and fail_at >= 1
        self._also = (method, self.calls[method] + fail_at)

    @property
    def armed(self) -> bool:
        return self._armed is not None

    def disarm(self) -> bool:
        """Forget the armed failure; return whether it was still pending."""
        pending, self._armed, self._also = self._armed is not None, None, None
        return pending

    def _fails(self, method: str) -> bool:
        self.calls[method] += 1
        if self._also is not None and self._also == (method, self.calls[method]):
            self._also = None
            self.failures += 1
            return True
        if self._armed is not None and self._armed[0] == method and self._armed[1] == self.calls[method]:
            self._armed = None
            self.failures += 1
            return True
        return False

    def create(self, pages: Sequence[PageId]) -> None:
        if self._fails("create"):
            raise BackendError("create", "injected failure")
        self.inner.create(pages)

    def map(self, address: int, pages: Sequence[PageId]) -> None:
        armed = self._armed
        if self._fails("map"):
            if armed is not None and armed[2] and len(pages) > 1:
                self.inner.map(address, pages[: len(pages) // 2])
            raise BackendError("mmap", "injected failure")
        self.inner.map(address, pages)

    def unmap(self, address: int, num_pages: int) -> None:
        if self._fails("unmap"):
            raise BackendError("mmap", "injected failure")
        self.inner.unmap(address, num_pages)

    def copy(self, pairs: Sequence[tuple[PageId, PageId]], nbytes: Sequence[int] | None = None) -> None:
        if self._fails("copy"):
            raise BackendError("copy", "injected failure")
        self.inner.copy(pairs, nbytes)

    def close(self) -> None:
        if self.resident_bytes_at_close is None:
            self.resident_bytes_at_close = self.inner.resident_bytes()
        self.inner.close()

    def __getattr__(self, name: str):  # ensure_id_space, release, reserve, tensor, ... unchanged
        return getattr(self.inner, name)


def memfd_mappings() -> list[str]:
    """The lines of ``/proc/self/maps`` that map a memfd (the rest is reserved or elsewhere)."""
    with open("/proc/self/maps") as f:
        return [line for line in f.read().splitlines() if "/memfd:" in line]


def read_mapped_pages(buf: VirtualBuffer, lines: list[str] | None = None) -> dict[tuple[int, int], int]:
    """``{(table row, page slot): physical page}`` for every page of the memfd mapped in ``buf``'s
    reservation, read from ``/proc/self/maps`` (the kernel's view, not the buffer's)."""
    page = buf.store.page_bytes
    lo, hi = buf.address, buf.address + buf.table.rows * buf.row_stride  # table rows: sub-rows too
    out: dict[tuple[int, int], int] = {}
    for line in memfd_mappings() if lines is None else lines:
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if end <= lo or start >= hi:
            continue
        assert fields[1] == "rw-s", f"unexpected mapping {line}"
        offset = int(fields[2], 16)
        for addr in range(max(start, lo), min(end, hi), page):  # it may run on into a neighbour
            rel = addr - lo
            out[(rel // buf.row_stride, rel % buf.row_stride // page)] = (offset + addr - start) // page
    return out


def expected_mapped_pages(buf: VirtualBuffer) -> dict[tuple[int, int], int]:
    """What the page table says must be mapped: each live slot's page, nothing else."""
    return {(r, row.start + k): int(p) for r, row in enumerate(buf.table) for k, p in enumerate(row.pages)}


def snapshot(*bufs: VirtualBuffer, id_space: bool = True,
             mapped: Callable[[VirtualBuffer], dict[tuple[int, int], int]] | None = None) -> dict:
    """Tables, pool state, mappings and readable bytes of ``bufs`` (all of one arena). ``mapped``
    reads what is mapped in a buffer (default: the kernel's memfd mappings; the GPU suite asks the
    driver); bytes are read back to the host."""
    pool = bufs[0].store.pool
    stats = pool.stats()
    if not id_space:  # a failed fork adds a segment of ids: names only, no memory
        stats = dataclasses.replace(stats, id_space=0)
    if mapped is None:
        lines = memfd_mappings()
        mapped = lambda b: read_mapped_pages(b, lines)  # noqa: E731
    return {
        "rows": [tuple(b.table) for b in bufs],
        "counters": [(b.table.cow_copies, b.table.remapped_rows, b.table.tail_copies) for b in bufs],
        "stats": stats,
        "in_use": pool.in_use_pages(),
        "resident_free": pool.resident_free_pages(),
        "refcounts": {p: pool.refcount(p) for p in pool.in_use_pages()},
        "mapped": [mapped(b) for b in bufs],
        "bytes": [
            [b.view(range(r, r + 1), b.first_live(r), b.length(r)).cpu().numpy().tobytes() for r in range(b.rows)]
            for b in bufs
        ],
    }


def read_rss(lo: int, hi: int) -> int:
    """Resident bytes of the mappings inside ``[lo, hi)`` as RSS counts them: once per mapping."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = start < hi and end > lo
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.fixture
def rss() -> Callable[[int, int], int]:
    """``rss(lo, hi)``: see :func:`read_rss`."""
    return read_rss


@pytest.fixture
def faulty_backend() -> Callable[..., FaultyBackend]:
    """``faulty_backend(page_bytes=...)`` makes a :class:`FaultyBackend`."""
    return FaultyBackend


@pytest.fixture
def mapped_pages() -> Callable[..., None]:
    """``mapped_pages(*bufs)`` asserts the kernel maps exactly what the buffers' page tables say."""

    def check(*bufs: VirtualBuffer) -> None:
        lines = memfd_mappings()
        for buf in bufs:
            assert read_mapped_pages(buf, lines) == expected_mapped_pages(buf)

    return check


@pytest.fixture
def buffer_snapshot() -> Callable[..., dict]:
    """``buffer_snapshot(*bufs, id_space=True)``: see :func:`snapshot`."""
    return snapshot


def assert_owner_lives_with_views(make: Callable[[object], torch.Tensor]) -> None:
    """``make(owner)`` wraps memory in a tensor through a DLPack capsule of ``hf_vkv.cuda.dlpack``
    that keeps ``owner`` alive: check that it lives exactly as long as the tensor or any view of it
    (one live capsule meanwhile, none after). ``make`` may check the tensor before returning it."""
    from hf_vkv.cuda.dlpack import live_capsules

    class Owner:
        """Something a tensor keeps alive (a reservation, in the backend)."""

    before = live_capsules()
    owner = Owner()
    ref = weakref.ref(owner)
    t = make(owner)
    del owner
    gc.collect()
    assert ref() is not None and live_capsules() == before + 1
    view = t[10:20]
    del t
    gc.collect()
    assert ref() is not None  # a view keeps the capsule, and so the owner
    del view
    gc.collect()
    assert ref() is None and live_capsules() == before

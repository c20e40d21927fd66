"""Spec of :class:`hf_vkv.prefix.page_check.MappedPages`: every page of a mapped prefix file is checked
against its checksum once, by the background check started at open or by the first use of an
entry holding it, whichever comes first; a damaged page is never passed, whoever reaches it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_vkv import PrefixFileCorruptError
from hf_vkv.prefix.page_check import SUM64, WEIGHTED64, MappedPages, page_checksums

PAGE = 4096
OFFSET = 2 * PAGE  # the header's room
BASE = 100  # the file's first page id in the arena


def _file(tmp_path: Path, pages: int, *, damage: int | None = None) -> tuple[Path, np.ndarray]:
    """A page file of random pages after ``OFFSET`` bytes, its checksums taken before ``damage``
    (a page index) gets a flipped bit."""
    data = torch.randint(0, 256, (pages, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(pages))
    sums = np.asarray(page_checksums(data, kind=WEIGHTED64), dtype=np.int64)
    if damage is not None:
        data[damage, 17] ^= 0x20
    path = tmp_path / "pages.kv"
    path.write_bytes(b"\0" * OFFSET + data.numpy().tobytes())
    return path, sums


def _open(path: Path, sums: np.ndarray) -> MappedPages:
    fd = os.open(path, os.O_RDONLY)
    try:
        return MappedPages(path, fd, list(range(BASE, BASE + len(sums))), sums, page_bytes=PAGE, data_offset=OFFSET,
                           kind=WEIGHTED64)
    finally:
        os.close(fd)


def test_the_background_check_reaches_every_page_and_the_first_use_reads_none_again(tmp_path: Path) -> None:
    n = 3 * MappedPages.CHUNK + 5
    pages = _open(*_file(tmp_path, n))
    assert pages.verified_bytes == 0  # opening reads nothing
    pages.check_in_background()
    pages.wait()
    assert pages.verified_bytes == n * PAGE
    pages.verify(range(BASE, BASE + n))
    assert pages.verified_bytes == n * PAGE  # nothing checked twice


def test_a_first_use_racing_the_thread_checks_each_page_once(tmp_path: Path) -> None:
    n = 4 * MappedPages.CHUNK
    pages = _open(*_file(tmp_path, n))
    pages.check_in_background()
    pages.verify(range(BASE + n - 10, BASE + n))  # the last chunk's pages, which the thread reaches last
    pages.verify(range(BASE, BASE + n))
    pages.wait()
    assert pages.verified_bytes == n * PAGE


@pytest.mark.parametrize("first_use", ["before the thread ends", "after it ends"])
def test_a_damaged_page_stops_the_thread_and_its_first_use_raises(tmp_path: Path, first_use: str) -> None:
    n, bad = 3 * MappedPages.CHUNK, MappedPages.CHUNK + 7
    pages = _open(*_file(tmp_path, n, damage=bad))
    pages.check_in_background()
    if first_use == "after it ends":
        pages.wait()
        assert pages.verified_bytes == MappedPages.CHUNK * PAGE  # the chunks before the damage only
    with pytest.raises(PrefixFileCorruptError, match=f"page {bad} differs"):
        pages.verify([BASE + bad])
    pages.wait()
    pages.verify(range(BASE, BASE + MappedPages.CHUNK))  # pages before it pass
    pages.verify(range(BASE + 2 * MappedPages.CHUNK, BASE + n))  # and after it, checked by this use
    with pytest.raises(PrefixFileCorruptError, match=f"page {bad} differs"):  # never passed later either
        pages.verify(range(BASE, BASE + n))


def test_a_child_forked_while_the_check_holds_the_lock_checks_on_its_own(tmp_path: Path) -> None:
    """A process forked while the background check held the lock (here: held by hand) gets a
    child whose first use checks its pages itself instead of waiting for a lock no thread of the
    child will release."""
    n = 2 * MappedPages.CHUNK
    path, sums = _file(tmp_path, n, damage=n - 3)
    pages = _open(path, sums)
    with pages._lock:  # what the thread holds while it sums a chunk
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the first use checked, and refused the damaged page
            try:
                pages.verify(range(BASE, BASE + 10))
                try:
                    pages.verify([BASE + n - 3])
                except PrefixFileCorruptError:
                    os._exit(0)
                os._exit(2)
            finally:
                os._exit(3)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child waited for the lock it inherited from the fork")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


def test_checking_pages_leaves_the_process_warning_filters_alone(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The check wrapped ``torch.frombuffer`` (which warns that the file's read-only pages are not
    writable) in ``warnings.catch_warnings()``, which swaps the process's filter list and is not
    thread-safe: two threads checking at once (one file's background check, another's first use)
    could leave "ignore UserWarning" in place for good, hiding every warning of the process,
    hf_vkv's own included. The check no longer swaps or changes the filters."""
    import warnings

    swaps: list[str] = []
    real = warnings.catch_warnings

    def counted(*args: object, **kwargs: object) -> object:
        swaps.append(threading.current_thread().name)
        return real(*args, **kwargs)

    n = 2 * MappedPages.CHUNK + 3
    files = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        files.append(_open(*_file(tmp_path / name, n)))
    before = list(warnings.filters)
    monkeypatch.setattr(warnings, "catch_warnings", counted)
    for pages in files:
        pages.check_in_background()
    for pages in files:
        pages.verify(range(BASE + n - 5, BASE + n))
        pages.wait()
        assert pages.verified_bytes == n * PAGE
    assert swaps == [] and warnings.filters == before

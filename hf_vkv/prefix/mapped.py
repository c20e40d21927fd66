"""A prefix store's pages in one file that later processes map instead of read.

:meth:`PrefixStore.save` writes ``prefix_store.kv`` beside its index: the physical pages of every
entry that can be mapped, each page once however many entries share it, page-aligned, after a
header page; the index (``prefix_store.json``, version 2 and later) describes each entry as what
its cache holds — per layer group, the page table of every part of its row, pages named by their index in
the file (:class:`~hf_vkv.cache.GroupImage`). :meth:`PrefixStore.load` opens the file and maps its
pages into the store's memory as *external* pages (:meth:`hf_vkv.memory.Arena.map_file`): no byte
of K/V is read or copied, processes that open one file share its page cache, and a row that writes
into a mapped page (the partly filled last page of a prefix) gets its own copy through the page
table; the file is never written.

**Layout of ``prefix_store.kv``**: a header at byte 0 (``MAGIC``, then the file id, the page size
and the page count, as JSON), zero-padded to ``data_offset`` (a multiple of the page size and of
the OS page); page ``i`` at ``data_offset + i * page_bytes``. The index names the file id, so an
index never maps another save's pages.

**The index's section** (version 4): ``checksum`` names how the pages' checksums were computed
(:data:`~hf_vkv.prefix.page_check.WEIGHTED64`; versions 2-3 hold plain sums,
:data:`~hf_vkv.prefix.page_check.SUM64`, and name none); ``checksums`` is one hex string, the
little-endian bytes of the pages' int64 checksums in file order; each table is ``[bytes held,
first page index, runs]`` with ``runs`` a list of ``[first file page, count]`` (a head-major
sub-row's pages are one run). Version 2 wrote the sums and the tables' pages as lists of
integers; both are read
(:func:`_file_checksums`, :func:`_table_runs`). The shorter text parses in about a third of the
time the lists took.

**Integrity, without reading everything first**: opening checks the index (its own SHA-256), the
header and the file's exact size — a truncated or swapped file is refused before anything is
mapped. Each page's checksum (:func:`~hf_vkv.prefix.page_check.page_checksums`: the wrapping sum
of its 64-bit words weighed by their places; any change within one word is caught, random damage
with probability 1 - 2**-64, and words or sectors that trade places within a page) is verified
before attention can read it: opening starts the check in a thread (:meth:`MappedPages.check_in_background`), and the first time
an entry's pages are handed out (:meth:`MappedPages.verify`, by :meth:`PrefixStore.borrow` and
:meth:`PrefixStore.take`) checks what that thread has not reached; each page is checked once. A
damaged page raises :class:`PrefixFileCorruptError` at that first use, the store drops every entry
of that file and stays usable. The sum is not a cryptographic hash: it does not defend against a file
crafted to pass it. A page file written after it was opened (``cp`` or ``rsync --inplace`` over
it, a truncation: its size or times changed) is seen at the store's next lookup or save, which
drops every entry holding its pages with a warning (:meth:`MappedPages.changed`); a write during
a turn that reads its pages is not (and a read past a truncated end then is a SIGBUS): replace a
served folder by saving into it (a new file), never write its page file in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import mmap
import os
import re
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import GroupGeometry, GroupImage, VKVCache
from ..memory import Arena, PageId, Row
from ..memory.errors import InvariantError
from .errors import PrefixFileCorruptError, PrefixFormatError
from .page_check import CHECKSUM_KINDS, SUM64, WEIGHTED64, MappedPages, page_checksums

__all__ = ["MAGIC", "PAGES_FILE", "MappedEntry", "clean_saves", "commit_lock", "pages_path", "TableRuns", "check_index_text", "index_text", "map_entries", "verify_file",
           "write_pages"]

PAGES_FILE = "prefix_store.kv"
MAGIC = b"HFVKVPG1"
_HEADER_MAX = 4096


_DIGEST_HEAD = '{"sha256":"'  # an index of version 2 or later starts so, then 64 hex digits of its own digest


def index_text(index: dict[str, Any]) -> str:
    """``index`` as the text of ``prefix_store.json``, its SHA-256 first: the digest of the text
    with those 64 digits zeroed (checked over the raw bytes at open, nothing re-serialized)."""
    text = json.dumps({"sha256": "0" * 64, **index}, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return _DIGEST_HEAD + digest + text[len(_DIGEST_HEAD) + 64:]


def check_index_text(path: Path, text: str) -> None:
    """Raise :class:`PrefixFileCorruptError` unless ``text`` (an index of version 2 or later) is whole: its
    leading digest equals the SHA-256 of the text with the digest zeroed."""
    n = len(_DIGEST_HEAD)
    digest = text[n:n + 64]
    if not text.startswith(_DIGEST_HEAD) or hashlib.sha256((text[:n] + "0" * 64 + text[n + 64:]).encode()).hexdigest() != digest:
        raise PrefixFileCorruptError(f"{path} is not whole: its digest differs (the index was edited or damaged)")


def saving_name(file_id: str) -> str:
    """The page file's name while its save is being committed (:func:`write_pages`): beside the
    last save's ``prefix_store.kv``, which stays whole until the new index names the new file."""
    return f"prefix_store.{os.getpid()}-{file_id[:16]}.kv"


def pages_path(folder: Path, section: dict[str, Any]) -> Path:
    """The page file of the save ``section`` describes: the file its index names, or
    ``prefix_store.kv`` where a save was stopped after it renamed the new file to that name and
    before it named it so in the index (its header's file id tells which save's it is)."""
    named = folder / str(section["file"])
    if not named.exists() and (folder / PAGES_FILE).exists():
        return folder / PAGES_FILE
    return named


@contextlib.contextmanager
def commit_lock(folder: Path) -> Iterator[None]:
    """Held while a save commits into ``folder`` (its index, the page file's rename to
    ``prefix_store.kv``, the index that names it so, the clean-up): saves from any processes or
    threads commit one at a time (an ``flock`` of the folder itself: no file is left behind), so
    an index never names ``prefix_store.kv`` while it holds another save's pages. Each save writes
    its page file under a name of its own before, unlocked."""
    with _folder_lock(folder, fcntl.LOCK_EX):
        yield


@contextlib.contextmanager
def read_lock(folder: Path) -> Iterator[None]:
    """Held while a load reads ``folder``'s index and opens the files it names (shared: loads run
    together): a save's commit (:func:`commit_lock`) never falls between them. Its first index
    names the page file by a name of its own, which the commit then renames to
    ``prefix_store.kv``: a load that had opened the file by the first name saw its change time
    move, took the file for rewritten, and dropped every entry it had loaded."""
    with _folder_lock(folder, fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def _folder_lock(folder: Path, mode: int) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # (closing it lets the lock go)


def clean_saves(folder: Path, keep: str) -> None:
    """Remove what saves into ``folder`` left behind when they were stopped (killed, or interrupted
    in this process): temporary files and page files of other saves than the one that just ended,
    never the file ``keep`` (the page file the index names) nor another running process's."""
    for path in folder.glob("*prefix_store*"):
        found = re.fullmatch(r"(?:\.prefix_store\.(?:kv|json)\.tmp-|prefix_store\.)(\d+)-[0-9a-f]+(?:\.kv)?", path.name)
        if found is None or path.name == keep or (int(found.group(1)) != os.getpid() and _running(int(found.group(1)))):
            continue
        with contextlib.suppress(OSError):
            path.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: running
        return True
    return True


def write_pages(folder: Path, entries: Sequence[tuple[tuple[int, ...], list[GroupImage]]]) -> dict[str, Any]:
    """Write the pages of ``entries`` (token ids, and their cache's :meth:`~VKVCache.row_images`)
    to a new page file in ``folder`` (:func:`saving_name`: a temporary name, then renamed; the
    save commits it by writing the index that names it) and return the index section that
    describes them. Every image must draw from one arena (the store's memory)."""
    stores = {id(img.store): img.store for _, images in entries for img in images}
    if len(stores) != 1 or not isinstance(next(iter(stores.values())), Arena):
        raise InvariantError("the entries' pages must live in one arena to be written as one file (PrefixStore.save "
                             "passes one arena's entries; a bug in hf_vkv)")
    arena: Arena = next(iter(stores.values()))
    page_bytes = arena.page_bytes
    index_of: dict[PageId, int] = {}
    for _, images in entries:
        for img in images:
            for page in img.pages():
                index_of.setdefault(page, len(index_of))
    pages = list(index_of)
    data_offset = -(-_HEADER_MAX // max(page_bytes, mmap.PAGESIZE)) * max(page_bytes, mmap.PAGESIZE)
    file_id = uuid.uuid4().hex
    header = json.dumps({"file_id": file_id, "page_bytes": page_bytes, "pages": len(pages),
                         "data_offset": data_offset}).encode()
    sums: list[int] = []
    path = folder / saving_name(file_id)
    tmp = folder / f".{PAGES_FILE}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(4, "little") + header)
            f.seek(data_offset)
            for at in range(0, len(pages), 256):  # a few MiB at a time
                chunk = arena.read_pages(pages[at:at + 256])
                sums.extend(page_checksums(chunk, kind=WEIGHTED64))
                f.write(chunk.numpy().tobytes())
            f.truncate(data_offset + len(pages) * page_bytes)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    first = entries[0][1] if entries else []
    section: dict[str, Any] = {
        "file": path.name, "file_id": file_id, "page_bytes": page_bytes, "pages": len(pages),
        "data_offset": data_offset, "file_bytes": data_offset + len(pages) * page_bytes,
        "checksum": WEIGHTED64, "checksums": np.array(sums, dtype="<i8").tobytes().hex(),
        "groups": [{"name": g.name, "members": list(g.members), "kv_heads": g.geometry.kv_heads,
                    "key_dim": g.geometry.key_dim, "value_dim": g.geometry.value_dim,
                    "dtype": str(g.geometry.dtype).removeprefix("torch."), "layout": g.layout,
                    "item_bytes": g.item_bytes, "parts": g.parts} for g in first],
        "entries": [{"tokens": list(tokens),
                     "groups": [{"lengths": list(g.lengths),
                                 "tables": [[t.length, t.start, _runs([index_of[p] for p in t.pages])] for t in g.tables]}
                                for g in images]}
                    for tokens, images in entries],
    }
    return section


def _runs(pages: list[int]) -> list[list[int]]:
    """``pages`` as ``[[first, count], ...]`` runs of consecutive indexes."""
    out: list[list[int]] = []
    for page in pages:
        if out and out[-1][0] + out[-1][1] == page:
            out[-1][1] += 1
        else:
            out.append([page, 1])
    return out


def _table_runs(pages: list, count: int) -> list[tuple[int, int]]:
    """A table's file pages from the index as runs ``[(first, count), ...]``: runs (version 3) or
    the indexes themselves (version 2), each checked inside the file's ``count`` pages
    (:class:`PrefixFormatError`, a ``ValueError``, otherwise)."""
    if len(pages) == 1 and isinstance(pages[0], list):  # one run: the common case
        (first, n), = pages
        first, n = int(first), int(n)
        if n <= 0 or first < 0 or first + n > count:
            raise PrefixFormatError(f"a run of pages empty or outside the file's {count}")
        return [(first, n)]
    if pages and isinstance(pages[0], list):
        runs = [(int(first), int(n)) for first, n in pages]
        if any(n <= 0 for _, n in runs):
            raise PrefixFormatError("an empty run of pages")
    else:
        runs = [(first, n) for first, n in _runs([int(p) for p in pages])]
    if any(first < 0 or first + n > count for first, n in runs):
        raise PrefixFormatError(f"a run of pages outside the file's {count}")
    return runs


def _page_ids(runs: list[tuple[int, int]], base: int) -> tuple[PageId, ...]:
    """The page ids (``base`` + file page index) of a table's ``runs``."""
    if len(runs) == 1:  # one run: the common case
        (first, n), = runs
        return tuple(range(base + first, base + first + n))  # type: ignore[arg-type]  # PageId is an int at run time
    return tuple(base + i for first, n in runs for i in range(first, first + n))  # type: ignore[misc]


def _file_checksums(section: dict[str, Any], count: int) -> tuple[np.ndarray, str]:
    """The section's ``count`` page checksums as int64 (one hex string since version 3, a list
    before) and how they were computed (``"checksum"``, since version 4; :data:`SUM64` before)."""
    kind = section.get("checksum", SUM64)
    if kind not in CHECKSUM_KINDS:
        raise PrefixFormatError(f"the index's page checksums are of an unknown kind {kind!r:.40} (this hf_vkv reads "
                                f"{', '.join(CHECKSUM_KINDS)}): a newer hf_vkv saved it")
    sums = section["checksums"]
    if isinstance(sums, str):
        out = np.frombuffer(bytes.fromhex(sums), dtype="<i8").astype(np.int64)
    else:
        out = np.array([int(x) for x in sums], dtype=np.int64)
    if len(out) != count:
        raise PrefixFormatError(f"{len(out)} checksums for {count} pages")
    return out, kind


def _check_whole(path: Path, fd: int, section: dict[str, Any], *, end: int) -> None:
    """Raise :class:`PrefixFileCorruptError` unless the page file open as ``fd`` has the header of
    the save ``section`` describes (its file id) and exactly ``end`` bytes."""
    head = os.pread(fd, _HEADER_MAX, 0)
    n = int.from_bytes(head[8:12], "little") if len(head) >= 12 else 0
    try:
        header = json.loads(head[12:12 + n]) if head[:8] == MAGIC else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("file_id") != section.get("file_id"):
        raise PrefixFileCorruptError(f"{path} is not whole: its header is damaged or it is another save's file (a "
                                     f"save into the folder from another process, running or stopped: load it again "
                                     f"once that save is done, or save it again)")
    size = os.fstat(fd).st_size
    if size != end:
        how = "truncated" if size < end else "bytes appended"
        raise PrefixFileCorruptError(f"{path} is not whole ({how}): {size:,} bytes, the index gives {end:,}")
    if size != section.get("file_bytes"):
        raise PrefixFileCorruptError(f"{path} is not whole: {size:,} bytes, and its index's file_bytes is "
                                     f"{section.get('file_bytes')!r:.40} (the index was edited or damaged)")


def _geometry(info: dict[str, Any], device: torch.device) -> GroupGeometry:
    dtype = getattr(torch, str(info["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise PrefixFormatError(f"unknown dtype {info['dtype']!r} in a prefix store index")
    return GroupGeometry(int(info["kv_heads"]), int(info["key_dim"]), int(info["value_dim"]), dtype, device)


#: A table of a mapped entry as the index gives it: ``(bytes held, first page index, runs)``, the
#: runs ``[(first file page, count), ...]`` (page ids are the file's first page id + file page).
TableRuns = tuple[int, int, list[tuple[int, int]]]


@dataclasses.dataclass(slots=True)
class MappedEntry:
    """A mapped file's entry before any cache holds it: its token ids, its row's shape (``shapes``:
    one :class:`GroupImage` per layer group with its geometry and lengths, no tables), its tables
    as the index gives them (``tables``, per group; pages in ``arena`` from id ``base`` on: the
    page tables, :attr:`images`, are built when first needed, not at open), and ``held``: the
    distinct pages of those tables, on each of which the entry holds one reference of the pool's,
    so no page it needs retires while no table holds it yet: the arena lists the entry as a holder
    meanwhile (:meth:`Arena.hold`; the invariant check counts its references). :meth:`install`
    puts the row into an empty cache and lets the references go; :meth:`release` lets them go
    without one (pages no one else holds retire)."""

    tokens: tuple[int, ...]
    shapes: list[GroupImage]
    tables: list[list[TableRuns]]
    base: int
    arena: Arena
    held: list[PageId]

    @property
    def images(self) -> list[GroupImage]:
        """The row's page tables, one :class:`GroupImage` per layer group."""
        return [dataclasses.replace(shape, tables=tuple(Row(length, start, _page_ids(runs, self.base))
                                                        for length, start, runs in tables))
                for shape, tables in zip(self.shapes, self.tables)]

    def referenced_pages(self) -> Iterator[PageId]:
        """The pages the entry holds a reference on, once each (the arena's invariant check)."""
        return iter(self.held)

    def held_bytes(self) -> Iterator[tuple[PageId, int]]:
        """None to check against append marks: a mapped file's pages have none."""
        return iter(())

    def check_invariants(self) -> None:
        """Until released, the entry holds exactly the pages of its tables, each also pinned (a
        mapped file's page)."""
        if not self.held:
            return
        refs = self.arena.pool.refs
        if set(self.held) != {p for img in self.images for p in img.pages()} \
                or any(refs.get(p, 0) < 2 for p in self.held):
            raise InvariantError(f"a mapped entry of {len(self.tokens)} tokens does not hold its pages (pin and "
                                 f"reference)")

    def install(self, cache: VKVCache) -> None:
        """Fill the empty batch-1 ``cache`` (of the store's memory) with this entry's row; the
        entry's own references go (the cache's tables hold the pages now)."""
        cache.install_row(self.images)
        self.release()

    def release(self) -> None:
        """Let the entry's references go (once)."""
        held, self.held = self.held, []
        if held:
            with self.arena.lock:
                self.arena.let_go(self)
                self.arena.pool.decref(held)


def map_entries(folder: Path, section: Any, *, memory: VKVCache, device: torch.device
                ) -> tuple[list[MappedEntry], MappedPages | None]:
    """Open ``folder``'s page file as ``section`` (the index's) describes it and map its pages
    into the arena ``memory`` (an empty cache of the store's memory) holds such rows in; return
    the entries, each holding its pages (:class:`MappedEntry`: no cache is made and no page table
    installed until an entry is first used), with the :class:`MappedPages`. Nothing stays mapped
    or held on an error.

    The index holding ``section`` was checked whole first (:func:`check_index_text`).

    Raises:
        PrefixFileCorruptError: the page file is missing, another save's, or not of the size the
            index gives.
        PrefixFormatError: the section is malformed, or its layout, page size or shapes do not fit
            the store's caches (``save`` and ``load`` with other ``cache_config`` options).
    """
    try:
        path = pages_path(folder, section)
        page_bytes, count, offset = int(section["page_bytes"]), int(section["pages"]), int(section["data_offset"])
        groups, entries, (sums, kind) = section["groups"], section["entries"], _file_checksums(section, count)
        if Path(section["file"]).name != section["file"]:
            raise PrefixFormatError(f"its file {section['file']!r} is not a name inside the folder")
    except (KeyError, TypeError, ValueError) as e:
        raise PrefixFormatError(f"{folder}: the mapped-pages section of its index is malformed ({e})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PrefixFileCorruptError(f"{folder} is not whole: it lacks {section['file']}, which its index names") from None
    out: list[MappedEntry] = []
    page_ids: Sequence[PageId] = ()
    arena: Arena | None = None
    parsed: list[tuple[tuple[int, ...], list[GroupImage], list[list[TableRuns]], np.ndarray]] = []
    try:
        _check_whole(path, fd, section, end=offset + count * page_bytes)
        shapes = [GroupImage(name=str(g["name"]), members=tuple(g["members"]), geometry=_geometry(g, device),
                             layout=str(g["layout"]), item_bytes=int(g["item_bytes"]), parts=int(g["parts"]),
                             page_bytes=page_bytes, lengths=(), tables=()) for g in groups]
        holds = np.zeros(count, dtype=np.int64)  # entries holding each file page
        for e in entries:  # everything is checked before a page is mapped
            if len(e["groups"]) != len(groups):
                raise PrefixFormatError(f"{folder}: an entry of its index describes {len(e['groups'])} groups, "
                                        f"not {len(groups)}")
            sized = [dataclasses.replace(shape, lengths=tuple(eg["lengths"])) for shape, eg in zip(shapes, e["groups"])]
            try:
                here = memory.arena_for_images(sized)
            except ValueError as err:
                raise PrefixFormatError(f"{folder}: its pages do not fit this store's caches ({err}); save and load "
                                        f"with the same cache_config") from None
            if arena is None:
                arena = here
            elif here is not arena:
                raise PrefixFormatError(f"{folder}: its entries would live in several arenas")
            held = np.zeros(count, dtype=bool)
            group_tables = []
            for eg in e["groups"]:
                try:  # [bytes held, first page index, file pages] per table; ints (the index was checked whole)
                    tables = [(int(length), int(start), _table_runs(pages, count)) for length, start, pages in eg["tables"]]
                except ValueError as err:
                    raise PrefixFormatError(f"{folder}: its index names pages it cannot ({err})") from None
                for _, _, runs in tables:
                    for first, n in runs:
                        held[first:first + n] = True
                group_tables.append(tables)
            holds += held
            parsed.append((tuple(map(int, e["tokens"])), sized, group_tables, np.flatnonzero(held)))
        if arena is None:
            return out, None
        page_ids = arena.map_file(fd, offset, count, holds=holds.tolist())  # each entry's references with the pins
        base = int(page_ids[0]) if page_ids else 0  # the file's pages have consecutive ids
        with arena.lock:
            for tokens, sized, group_tables, held in parsed:
                out.append(MappedEntry(tokens, sized, group_tables, base, arena, (held + base).tolist()))
                arena.hold(out[-1])
        return out, MappedPages(path, fd, page_ids, sums, page_bytes=page_bytes, data_offset=offset, kind=kind,
                                arena=arena)
    except BaseException as e:
        for entry in out:
            entry.release()
        if arena is not None and page_ids:
            base = int(page_ids[0])
            with arena.lock:  # the references of entries not made yet, then the pins
                arena.pool.decref([p for *_, held in parsed[len(out):] for p in (held + base).tolist()])
                arena.pool.retire_unheld(page_ids)
        if isinstance(e, (KeyError, TypeError, IndexError)):
            raise PrefixFormatError(f"{folder}: the mapped-pages section of its index is malformed ({e!r})") from None
        raise
    finally:
        os.close(fd)


def verify_file(folder: Path, section: Any, *, pages: bool = True) -> int:
    """Read ``folder``'s page file whole and check every page against the index ``section``:
    return the pages checked, or raise :class:`PrefixFileCorruptError` naming the first that
    differs (or a file of the wrong size or another save). What ``hf-vkv prefix inspect --verify``
    runs (on an index checked whole); a store checks pages lazily instead (:class:`MappedPages`).
    ``pages=False``: only the file's header and size, no page read (what ``inspect`` always runs);
    returns 0."""
    path = pages_path(folder, section)
    page_bytes, count, offset = int(section["page_bytes"]), int(section["pages"]), int(section["data_offset"])
    if not path.is_file():
        raise PrefixFileCorruptError(f"{folder} is not whole: it lacks {path.name}, the page file its index names")
    with open(path, "rb") as f:
        _check_whole(path, f.fileno(), section, end=offset + count * page_bytes)
        if not pages:
            return 0
        f.seek(offset)
        sums, kind = _file_checksums(section, count)
        for at in range(0, count, 256):
            k = min(256, count - at)
            data = torch.frombuffer(bytearray(f.read(k * page_bytes)), dtype=torch.uint8).view(k, page_bytes)
            for i, got in enumerate(page_checksums(data, kind=kind)):
                if got != sums[at + i]:
                    raise PrefixFileCorruptError(f"{path} is not whole: page {at + i} differs from its checksum")
    return count

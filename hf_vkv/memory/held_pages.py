"""The physical pages a cache holds, and bytes held by many holders with shared pages counted once.

:class:`HeldPages` is what one holder (a cache, a stored prefix) holds: per page store its page
ids, each once, as an array, and the tensors of layers kept outside page stores by key.
:class:`PageCounts` counts, per page, how many holders added hold it, and the bytes of the pages
at least one holds: adding or removing a holder costs a few array operations over its ids, not a
Python step per page (a stored prefix of SmolLM2 at 2k tokens holds ~24k pages, and a chat turn
adds one holder and removes another).

Invariant: :attr:`PageCounts.bytes` is the sum, over the pages whose count is positive, of their
store's page bytes, plus the bytes of the kept tensors held at least once; no count is negative.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from .errors import InvariantError

__all__ = ["HeldPages", "PageCounts"]


@dataclass(frozen=True, slots=True, eq=False)
class HeldPages:
    """What one holder holds: ``pages`` maps a page store to ``(page bytes, ids)`` (int64, each id
    once), ``tensors`` a kept tensor's key to its bytes."""

    pages: dict[object, tuple[int, np.ndarray]] = field(default_factory=dict)
    tensors: dict[Hashable, int] = field(default_factory=dict)

    @classmethod
    def of(cls, stores: Iterable[tuple[object, int, Iterable[int]]], tensors: dict[Hashable, int] | None = None
           ) -> HeldPages:
        """From ``(store, page bytes, page ids)`` triples (a store may come more than once, an id
        may repeat: each is held once)."""
        ids: dict[object, list[np.ndarray]] = {}
        sizes: dict[object, int] = {}
        for store, page_bytes, pages in stores:
            ids.setdefault(store, []).append(np.fromiter(pages, dtype=np.int64))
            sizes[store] = page_bytes
        return cls({s: (sizes[s], np.unique(np.concatenate(parts))) for s, parts in ids.items()}, dict(tensors or {}))

    def __iter__(self) -> Iterator[Hashable]:
        """Each page's key ``(store, id)``, then each kept tensor's: what two holders share is the
        keys both hold (``set(a) & set(b)``)."""
        for store, (_, ids) in self.pages.items():
            yield from zip(repeat(store), ids.tolist())
        yield from self.tensors

    def __len__(self) -> int:
        return sum(len(ids) for _, ids in self.pages.values()) + len(self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of every page and tensor held, each once."""
        return sum(size * len(ids) for size, ids in self.pages.values()) + sum(self.tensors.values())


class PageCounts:
    """How many added holders hold each page (see the module docstring); :attr:`bytes` is what they
    hold together, each page once."""

    def __init__(self) -> None:
        # a store's entries go when it holds no page any more: the counts keep no store alive
        self._counts: dict[object, np.ndarray] = {}  # store -> int32 count per page id
        self._live: dict[object, int] = {}  # store -> its pages whose count is positive
        self._tensors: Counter[Hashable] = Counter()
        self._tensor_bytes: dict[Hashable, int] = {}
        self.bytes = 0

    def add(self, held: HeldPages) -> None:
        for store, (size, ids) in held.pages.items():
            if not len(ids):
                continue
            counts = self._counts.get(store)
            top = int(ids[-1]) + 1  # ids are sorted (HeldPages.of)
            if counts is None or len(counts) < top:
                grown = np.zeros(max(top, 2 * len(counts) if counts is not None else top), dtype=np.int32)
                if counts is not None:
                    grown[:len(counts)] = counts
                counts = self._counts[store] = grown
            new = int(np.count_nonzero(counts[ids] == 0))
            self.bytes += size * new
            self._live[store] = self._live.get(store, 0) + new
            counts[ids] += 1
        for key, nbytes in held.tensors.items():
            if not self._tensors[key]:
                self._tensor_bytes[key] = nbytes
                self.bytes += nbytes
            self._tensors[key] += 1

    def remove(self, held: HeldPages) -> None:
        """Undo one :meth:`add` of ``held`` (:class:`InvariantError` if it was not added: nothing changes)."""
        for store, (size, ids) in held.pages.items():
            counts = self._counts.get(store)
            if len(ids) and (counts is None or len(counts) <= ids[-1] or not counts[ids].all()):
                raise InvariantError("a holder's pages are removed from page counts that do not hold them")
        if any(not self._tensors[key] for key in held.tensors):
            raise InvariantError("a holder's tensors are removed from page counts that do not hold them")
        for store, (size, ids) in held.pages.items():
            if len(ids):
                counts = self._counts[store]
                counts[ids] -= 1
                freed = int(np.count_nonzero(counts[ids] == 0))
                self.bytes -= size * freed
                self._live[store] -= freed
                if not self._live[store]:
                    del self._counts[store], self._live[store]
        for key in held.tensors:
            self._tensors[key] -= 1
            if not self._tensors[key]:
                del self._tensors[key]
                self.bytes -= self._tensor_bytes.pop(key)

    def same_as(self, other: PageCounts) -> bool:
        """Whether both count the same holders of every page and the same bytes."""
        if self._counts.keys() != other._counts.keys():
            return False
        for store, a in self._counts.items():
            b = other._counts[store]
            n = max(len(a), len(b))  # the arrays grow on their own
            if not np.array_equal(np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))):
                return False
        return self.bytes == other.bytes and +self._tensors == +other._tensors

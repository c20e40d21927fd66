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
    hold together, each page once.

    Per page store the counted ids are a sorted array with their counts beside it (only ids held
    at least once): an add or a remove costs a few array operations over the ids it names and
    those counted, never over the store's whole id space, which grows with the rows' capacity
    (a 10**9-token capacity gives a store ~10**10 ids; a dense count per id was 45 GB)."""

    def __init__(self) -> None:
        # a store's entries go when it holds no page any more: the counts keep no store alive
        self._ids: dict[object, np.ndarray] = {}  # store -> its counted page ids, sorted (int64)
        self._counts: dict[object, np.ndarray] = {}  # store -> each counted id's holders (int32, all > 0)
        self._tensors: Counter[Hashable] = Counter()
        self._tensor_bytes: dict[Hashable, int] = {}
        self.bytes = 0

    def add(self, held: HeldPages) -> None:
        for store, (size, ids) in held.pages.items():
            if not len(ids):
                continue
            have, counts = self._ids.get(store), self._counts.get(store)
            if have is None:
                self._ids[store], self._counts[store] = ids.copy(), np.ones(len(ids), dtype=np.int32)
                self.bytes += size * len(ids)
                continue
            at = np.searchsorted(have, ids)  # ids are sorted and unique (HeldPages.of)
            known = at < len(have)
            known[known] = have[at[known]] == ids[known]
            counts[at[known]] += 1
            new = ids[~known]
            if len(new):
                self._ids[store] = np.insert(have, at[~known], new)
                self._counts[store] = np.insert(counts, at[~known], 1)
                self.bytes += size * len(new)
        for key, nbytes in held.tensors.items():
            if not self._tensors[key]:
                self._tensor_bytes[key] = nbytes
                self.bytes += nbytes
            self._tensors[key] += 1

    def remove(self, held: HeldPages) -> None:
        """Undo one :meth:`add` of ``held`` (:class:`InvariantError` if it was not added: nothing changes)."""
        places = {}
        for store, (size, ids) in held.pages.items():
            if not len(ids):
                continue
            have = self._ids.get(store)
            at = np.searchsorted(have, ids) if have is not None else None
            if at is None or at[-1] >= len(have) or not np.array_equal(have[at], ids):
                raise InvariantError("a holder's pages are removed from page counts that do not hold them")
            places[store] = (size, at)
        if any(not self._tensors[key] for key in held.tensors):
            raise InvariantError("a holder's tensors are removed from page counts that do not hold them")
        for store, (size, at) in places.items():
            counts = self._counts[store]
            counts[at] -= 1
            freed = counts == 0
            gone = int(np.count_nonzero(freed))
            if gone:
                self.bytes -= size * gone
                if gone == len(counts):
                    del self._ids[store], self._counts[store]
                else:
                    self._ids[store], self._counts[store] = self._ids[store][~freed], counts[~freed]
        for key in held.tensors:
            self._tensors[key] -= 1
            if not self._tensors[key]:
                del self._tensors[key]
                self.bytes -= self._tensor_bytes.pop(key)

    def same_as(self, other: PageCounts) -> bool:
        """Whether both count the same holders of every page and the same bytes."""
        if self._ids.keys() != other._ids.keys():
            return False
        for store, ids in self._ids.items():
            if not (np.array_equal(ids, other._ids[store]) and np.array_equal(self._counts[store], other._counts[store])):
                return False
        return self.bytes == other.bytes and +self._tensors == +other._tensors

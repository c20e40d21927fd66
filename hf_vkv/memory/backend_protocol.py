"""The physical-memory backend protocol shared by the host (memfd/mmap) and CUDA (VMM) backends.

A backend owns physical pages named by :data:`~hf_vkv.memory.pool.PageId` (page ``p`` is the
``p``-th page of its physical space) and virtual address ranges it reserves. It makes no policy
decisions: the page tables say what to map where, the backend does it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .map_budget import MapBudget
from .pool import PageId

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    """What a physical-memory backend provides.

    Addresses are plain ints. Every method raises :class:`~hf_vkv.memory.errors.BackendError`
    naming the failing system or driver call; a failed call leaves what it had not yet done
    undone (``map`` of a run may leave a prefix mapped: the caller unmaps on rollback).
    """

    page_bytes: int  # bytes of one physical page (the mapping granularity)
    device: torch.device  # where the memory lives
    #: The process's mapping budget each mapping of this backend counts against (the host's
    #: ``vm.max_map_count``), or ``None`` where mappings are not a per-process limit (CUDA's VMM).
    map_budget: MapBudget | None
    #: Whether :meth:`copy` reads every source before it writes any destination (one batched copy).
    gathered_copies: bool

    def ensure_id_space(self, num_pages: int) -> None:
        """Make page ids ``0 .. num_pages-1`` addressable (no memory is committed)."""

    def create(self, pages: Sequence[PageId]) -> None:
        """Back ``pages`` with physical memory before their first use."""

    def release(self, pages: Sequence[PageId]) -> None:
        """Give the memory of ``pages`` back; they are unmapped everywhere or never read again."""

    def reserve(self, nbytes: int, *, readable: bool = False) -> int:
        """Reserve ``nbytes`` (a multiple of ``page_bytes``) of page-aligned virtual address space.

        ``readable``: every page slot of the range that holds no mapped page stays readable (it
        reads as zeros) and writable without effect on any page (host: a private anonymous
        mapping; CUDA: one scratch page mapped at every such slot); :meth:`unmap` restores that.
        Otherwise an unmapped slot is inaccessible (reading it kills the process or context)."""

    def unreserve(self, address: int, nbytes: int) -> None:
        """Give back a whole reservation made by :meth:`reserve` (nothing in it may be in use)."""

    def map(self, address: int, pages: Sequence[PageId]) -> None:
        """Map ``pages[k]`` at ``address + k * page_bytes`` (inside a reservation), read-write."""

    def unmap(self, address: int, num_pages: int) -> None:
        """Unmap ``num_pages`` pages from ``address`` on; the range stays reserved (and readable if
        it was reserved so)."""

    def reset(self, address: int, nbytes: int) -> None:
        """Unmap every page of the whole reservation at ``address`` at once, leaving it reserved
        as :meth:`reserve` made it (the last resort of a rollback that failed: no hole, nothing
        stale mapped)."""

    def copy(self, pairs: Sequence[tuple[PageId, PageId]], nbytes: Sequence[int] | None = None) -> None:
        """Copy the bytes of page ``src`` to page ``dst`` for each ``(src, dst)``: the first
        ``nbytes[k]`` of them (a copy-on-write of a partly written page), or all of them. A page may
        be the ``src`` of one pair and the ``dst`` of a later one, never the reverse: run the copies
        in order, or read every source before writing any destination (one batched copy). A
        backend that always does the latter says so with :attr:`gathered_copies`; then a page may
        also be written before it is read (a reorder's swap of two rows' tails)."""

    def tensor(self, address: int, nbytes: int, owner: object) -> torch.Tensor:
        """A zero-copy ``uint8`` tensor ``[nbytes]`` over ``[address, address + nbytes)`` that keeps
        ``owner`` alive as long as the tensor (or any view of it) lives."""

    def resident_bytes(self) -> int:
        """Physical bytes the backend holds now, as the operating system or driver counts them."""

    def close(self) -> None:
        """Release everything; reservations still referenced by tensors go when those tensors do."""

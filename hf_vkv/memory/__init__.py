"""Backend-neutral memory: page ids and the pool, page tables, the invariant over both, page
stores, the backend protocol, the host backend and the row buffers with their translators.
Nothing here imports transformers.

A *page slot* is a page-sized place in a reserved virtual range: slot ``i`` of a row's range is
where the row's ``i``-th page is mapped (``address + i * page_bytes``); the CUDA backend's copy
window has slots too, one per page handle. That is the only meaning of "slot" in hf_vkv (a layer's
index in its group is its *member* index; a token's place in a paged-layout block, its position
in the block)."""

from .backend_protocol import Backend
from .arena import Arena
from .invariants import check_pages
from .page_store import OpenTables, PageStore
from .block_buffer import BlockBuffer, BlockStore
from .virtual_buffer import VirtualBuffer
from .errors import (
    BackendError,
    CacheClosedError,
    CapacityError,
    InvariantError,
    KVCacheOutOfMemory,
    VKVError,
)
from .host_backend import HostBackend
from .interrupts import SectionLock, guarded, register_critical, section
from .limits import PageSizeError
from .map_budget import MappingLimitError
from .page_table import CowCopy, PageTable, Row
from .pool import PageId, PagePool, PoolStats
from .row_buffer import BufferStats, RowBuffer
from .subrow_buffer import SubRowBuffer

__all__ = [
    "Arena", "Backend", "BackendError", "BlockBuffer", "BlockStore", "BufferStats", "CacheClosedError", "CapacityError", "CowCopy",
    "HostBackend", "InvariantError", "KVCacheOutOfMemory", "MappingLimitError", "PageSizeError", "OpenTables", "PageId", "PagePool",
    "PageStore", "PageTable", "PoolStats", "Row", "RowBuffer", "SectionLock", "SubRowBuffer", "VKVError", "VirtualBuffer", "check_pages", "guarded", "register_critical", "section",
]

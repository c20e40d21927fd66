"""Backend-neutral memory: page ids and the pool, page tables, the backend protocol, the host
backend and the virtual buffer. Nothing here imports transformers."""

from .backend import Backend
from .arena import Arena, PageStore
from .blocks import BlockBuffer, BlockStore
from .buffer import VirtualBuffer
from .errors import (
    BackendError,
    CacheClosedError,
    CapacityError,
    InvariantError,
    KVCacheOutOfMemory,
    VKVError,
)
from .host import DEFAULT_HOST_PAGE_BYTES, HostBackend
from .page_table import CowCopy, PageTable, Row
from .pool import PageId, PagePool, PoolStats
from .rows import BufferStats, RowBuffer

__all__ = [
    "Arena", "Backend", "BackendError", "BlockBuffer", "BlockStore", "BufferStats", "CacheClosedError", "CapacityError", "CowCopy",
    "DEFAULT_HOST_PAGE_BYTES", "HostBackend", "InvariantError", "KVCacheOutOfMemory", "PageId", "PagePool",
    "PageStore", "PageTable", "PoolStats", "Row", "RowBuffer", "VKVError", "VirtualBuffer",
]

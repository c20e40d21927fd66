"""Backend-neutral memory: page ids and the pool, page tables, the backend protocol, the host
backend and the virtual buffer. Nothing here imports transformers."""

from .backend import Backend
from .buffer import Arena, BufferStats, VirtualBuffer
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

__all__ = [
    "Arena", "Backend", "BackendError", "BufferStats", "CacheClosedError", "CapacityError", "CowCopy",
    "DEFAULT_HOST_PAGE_BYTES", "HostBackend", "InvariantError", "KVCacheOutOfMemory", "PageId", "PagePool",
    "PageTable", "PoolStats", "Row", "VKVError", "VirtualBuffer",
]

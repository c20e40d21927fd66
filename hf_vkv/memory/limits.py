"""Bounds no option may cross: the page sizes vkv accepts; and what the host has available.

* **Page size.** Every page is a multiple of the OS page (4 KiB). On the host the range is
  4 KiB .. 2 MiB: 4 KiB head-major pages decode within 1.5 % of an ideal preallocated cache and
  256 KiB token-major pages are the token-major default (README, ``docs/layouts.md``); decode is
  flat across the range (``benchmarks/page_size_cpu.py``: SmolLM2 fp32, 512 x 4, head-major,
  one thread: 72.2 / 71.5 / 70.0 ms per step at 4 KiB / 64 KiB / 2 MiB, the same 95.6 MiB of
  memfd), so a page larger than the huge-page size buys nothing, while every page counts whole
  against the budget and a sub-row strands up to one (16 MiB pages were seen to hold 512 MiB of
  memfd for 34 KiB of tokens; a 1 TiB page filled the machine's shared memory). On
  CUDA a page is a multiple of the driver's allocation granularity (2 MiB on H100/H200) and at
  most :data:`MAX_CUDA_PAGE_BYTES`. ``CacheOptions`` refuses a size outside the union of both
  ranges when the cache is built; each backend refuses what is outside its own.
* **Host memory.** :func:`mem_available` reads ``MemAvailable``, of which a host arena with no
  ``budget_bytes`` takes a share (:data:`hf_vkv.devices.HOST_BUDGET_FRACTION`).
"""

from __future__ import annotations

import contextlib

from .errors import VKVError

__all__ = ["MAX_CUDA_PAGE_BYTES", "MAX_HOST_PAGE_BYTES", "MIN_PAGE_BYTES", "PageSizeError", "check_page_bytes",
           "mem_available"]

MIN_PAGE_BYTES = 4096
MAX_HOST_PAGE_BYTES = 2 << 20
MAX_CUDA_PAGE_BYTES = 32 << 20


class PageSizeError(VKVError, ValueError):
    """``page_bytes`` is outside the range a backend accepts (the message names the range)."""


def check_page_bytes(page_bytes: int, *, low: int = MIN_PAGE_BYTES, high: int = MAX_CUDA_PAGE_BYTES,
                     where: str = "") -> None:
    """Raise :class:`PageSizeError` unless ``low <= page_bytes <= high`` and a multiple of 4 KiB."""
    if not low <= page_bytes <= high or page_bytes % MIN_PAGE_BYTES:
        raise PageSizeError(
            f"cache_config['page_bytes']={page_bytes:,} is outside the supported range{where}: a multiple of "
            f"{MIN_PAGE_BYTES:,} bytes from {low:,} to {high:,} (host: 4 KiB .. 2 MiB; CUDA: multiples of the "
            f"driver's granularity up to {MAX_CUDA_PAGE_BYTES >> 20} MiB); leave it unset for the layout's default"
        )


def mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


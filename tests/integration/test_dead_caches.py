"""A cache nobody refers to any more returns its pages, memfds and mappings at once: no reference
cycle between a VKVCache and its parts, so no wait for the cycle collector."""

from __future__ import annotations

import gc
import os

import pytest

import hf_vkv
from models import SMALL_PAGE, prompts, tiny

pytestmark = pytest.mark.integration


def _held() -> tuple[int, int, int]:
    """(open fds, mappings, bytes allocated in memfds) of this process. Mappings: every line of
    ``/proc/self/maps`` but the private read-write anonymous ones (and ``[heap]``), which malloc
    and torch's allocator grow, merge and split as they please (a run of 300 calls ended one
    such region split in two); vkv's are its memfd pages (shared), its reservations (no access,
    or read-only) and the private copy-on-write maps of prefix files (with their path)."""
    fds = mapped = memfd_bytes = 0
    for name in os.listdir("/proc/self/fd"):
        fds += 1
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                memfd_bytes += os.fstat(int(name)).st_blocks * 512
        except OSError:
            continue  # the directory's own fd, closed meanwhile
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            path = fields[5] if len(fields) > 5 else ""
            mapped += not (fields[1] == "rw-p" and (not path or path == "[heap]"))
    return fds, mapped, memfd_bytes


MIXED = [
    dict(do_sample=False),
    dict(num_beams=3, do_sample=False),
    dict(do_sample=True, num_return_sequences=2),
    dict(do_sample=False, cache_config={"layout": "token_major"}),
    dict(num_beams=2, do_sample=False, cache_config={"layout": "head_major", "page_bytes": SMALL_PAGE}),
]


def test_300_generate_calls_without_the_cycle_collector_hold_nothing() -> None:
    model = tiny("llama")
    inputs = prompts(2, 12, seed=1)
    model.generate(**inputs, max_new_tokens=2, cache_implementation="vkv")  # first-use imports and caches
    gc.collect()
    gc.disable()
    try:
        before = _held()
        for i in range(300):
            kwargs = dict(MIXED[i % len(MIXED)])
            model.generate(**inputs, max_new_tokens=3, cache_implementation="vkv", **kwargs)
            if i % 100 == 99:
                assert _held() == before, f"after {i + 1} calls: (fds, mappings, memfd bytes) {_held()} != {before}"
        cache = hf_vkv.VKVCache(model.config, page_bytes=SMALL_PAGE)
        model(**inputs, **{hf_vkv.generate.cache_kwarg(): cache})
        fork = cache.fork()
        assert _held() != before  # the check sees a live cache ...
        del cache, fork
        assert _held() == before  # ... and its release, at once
    finally:
        gc.enable()

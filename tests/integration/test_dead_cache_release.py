"""Dead caches release at once: with the cycle collector off, 300 mixed ``generate`` calls leave
file descriptors, mappings and memfd bytes flat (a cache is freed by reference counting when
``generate`` returns, so no page waits for ``gc``)."""

from __future__ import annotations

import gc
import os

import torch
from models import prompts, tiny

import hf_vkv  # noqa: F401  (registers "vkv")
from hf_vkv import VKVCache


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def memfd_bytes() -> int:
    """Bytes every memfd open in this process holds (allocated blocks)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            pass
    return total


def test_300_generate_calls_without_gc_hold_nothing():
    model = tiny("llama")
    inputs = prompts(2, 12)
    modes = [
        {},
        {"num_beams": 2},
        {"do_sample": True, "num_return_sequences": 2},
        {"cache_config": {"layout": "token_major"}},
        {"return_dict_in_generate": True},  # the output holds the cache until it is dropped
    ]
    model.generate(**inputs, max_new_tokens=3, cache_implementation="vkv", pad_token_id=0)  # warm-up
    gc.collect()
    gc.disable()
    try:
        base = (fds(), mappings(), memfd_bytes())
        peak = list(base)
        for i in range(300):
            out = model.generate(**inputs, max_new_tokens=3, cache_implementation="vkv", pad_token_id=0,
                                 **modes[i % len(modes)])
            if i % len(modes) == 4:
                assert isinstance(out.past_key_values, VKVCache)
            del out
            now = (fds(), mappings(), memfd_bytes())
            peak = [max(a, b) for a, b in zip(peak, now)]
        end = (fds(), mappings(), memfd_bytes())
    finally:
        gc.enable()
    assert end[0] == base[0] and peak[0] <= base[0], (base, peak, end)  # no fd outlives its call
    assert end[2] == base[2] == 0 and peak[2] == 0, (base, peak, end)  # no dead cache's pages held
    # mappings: none left behind (a few may come and go with the allocator; never one per call)
    assert end[1] <= base[1] + 8 and peak[1] <= base[1] + 8, (base, peak, end)

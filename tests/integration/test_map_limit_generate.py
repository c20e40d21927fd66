"""The mapping limit in ``generate``: a model with many head-major sub-rows reaches an
injected ``vm.max_map_count`` and gets a typed :class:`KVCacheOutOfMemory` naming the limit, with
the process and the next calls unharmed; after the fix the error names (token-major) the same
call runs and gives DynamicCache's tokens. The limit is injected (a few hundred mappings above
what the process holds), except in the one test that fills a subprocess near the machine's own."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from models import assert_same_tokens, prompts, tiny

import hf_vkv  # noqa: F401
from hf_vkv.memory import KVCacheOutOfMemory
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError, process_mappings, read_max_map_count


def test_generate_past_the_mapping_limit_is_refused_and_the_process_goes_on():
    model = tiny("llama", layers=4, kv_heads=4)  # 4 layers x K/V x 4 heads = 32 sub-rows per row
    inputs = prompts(4, 20)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    reference = model.generate(**inputs, **kwargs)  # DynamicCache
    gc.collect()
    held = PROCESS_MAP_BUDGET.held
    limit = process_mappings() + 150  # room for ~2 rows of head-major sub-rows, not 4 x 2 beams
    with PROCESS_MAP_BUDGET.override(limit=limit, headroom=0):
        for attempt in range(2):  # the same refusal twice: nothing was left half done
            with pytest.raises(KVCacheOutOfMemory) as info:
                model.generate(**inputs, cache_implementation="vkv", num_beams=2,
                               cache_config={"layout": "head_major"}, **kwargs)  # (short beams: token-major by default)
            assert isinstance(info.value, MappingLimitError)
            message = str(info.value)
            assert f"vm.max_map_count is {limit:,}" in message and "token_major" in message and "\n" not in message
            del info
            gc.collect()
            assert PROCESS_MAP_BUDGET.held == held  # the refused cache gave back what it held
        # the fix the message names: token-major maps one range per row, not one per layer and head
        out = model.generate(**inputs, cache_implementation="vkv", cache_config={"layout": "token_major"},
                             **kwargs)
        assert_same_tokens(reference, out)
    assert_same_tokens(reference, model.generate(**inputs, cache_implementation="vkv", **kwargs))


_FULL_PROCESS = r"""
import ctypes, gc, mmap, sys, time
sys.path.insert(0, {tests!r})
from models import assert_same_tokens, prompts, tiny
import hf_vkv  # noqa: F401
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError, process_mappings

model = tiny("llama", layers=4, kv_heads=4)  # 32 head-major sub-rows a row
inputs = prompts(4, 20)
kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, num_beams=2)
vkv = dict(cache_implementation="vkv", cache_config={{"layout": "head_major"}})
reference = model.generate(**inputs, **kwargs)  # DynamicCache: vkv has mapped nothing in this process yet
if {vkv_first}:  # vkv runs first: the budget counts the process while it is small
    assert_same_tokens(reference, model.generate(**inputs, **vkv, **kwargs))
    PROCESS_MAP_BUDGET.STALE_S = 0.5  # (5 s by default)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
page, limit = mmap.PAGESIZE, PROCESS_MAP_BUDGET.limit
pages = limit - 2000 - process_mappings()  # a filler that leaves 2,000 mappings to the process
filler = libc.mmap(None, pages * page, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)  # 0x4000: MAP_NORESERVE
for i in range(1, pages, 2):  # every other page PROT_NONE: each adds two mappings (it and the rest)
    assert libc.mprotect(filler + i * page, page, 0) == 0
others = process_mappings()
print("filled", others, "of", limit)
if {vkv_first}:
    time.sleep(0.6)  # the budget's count of the rest of the process is older than STALE_S now
for attempt in range(2):  # refused before any change, twice: nothing was left half done
    try:
        model.generate(**inputs, **vkv, **kwargs)
    except MappingLimitError as e:
        assert f"vm.max_map_count is {{limit:,}}" in str(e) and e.others >= others - 100, str(e)
        print("refused", attempt)
    else:
        raise AssertionError("generate ran past the budget")
    gc.collect()
    assert PROCESS_MAP_BUDGET.held == 0
assert libc.munmap(filler, pages * page) == 0
assert_same_tokens(reference, model.generate(**inputs, **vkv, **kwargs))
print("ok")
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux: the kernel's per-process mapping limit")
@pytest.mark.skipif(read_max_map_count() > 300_000, reason="vm.max_map_count is raised here: too many mappings to "
                                                             "fill in a test")
@pytest.mark.parametrize("vkv_first", [False, True], ids=["filled_before_vkv", "filled_after_vkv_counted"])
def test_a_process_that_holds_most_of_the_limit_is_refused_before_any_change(vkv_first):
    """The process's budget looks at ``/proc/self/maps`` only at the first change that maps pages
    (a reservation is let through before: a process's first prefix open maps nothing). A process
    that already holds all but 2,000 of ``vm.max_map_count`` mappings (a filler of single-page
    mappings) when vkv first runs is refused with the typed :class:`MappingLimitError` naming the
    limit and its count, before anything is mapped, twice; once the filler is gone the same call
    gives DynamicCache's tokens. Run in a subprocess: the filler takes the process near the real
    limit. ``filled_after_vkv_counted``: vkv ran first (the budget counted a small process), then
    the process grew: a check more than ``STALE_S`` seconds after that count counts again, so the
    refusal is the same (before, the budget went by its old count and let the step map into the
    2,000 left to the rest of the process)."""
    code = _FULL_PROCESS.format(tests=str(Path(__file__).parents[1]), vkv_first=vkv_first)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.split("\n")[1:4] == ["refused 0", "refused 1", "ok"], done.stdout

"""The mapping limit in ``generate``: a model with many head-major sub-rows reaches an
injected ``vm.max_map_count`` and gets a typed :class:`KVCacheOutOfMemory` naming the limit, with
the process and the next calls unharmed; after the fix the error names (token-major) the same
call runs and gives DynamicCache's tokens. The limit is injected (a few hundred mappings above
what the process holds), never the machine's."""

from __future__ import annotations

import gc

import pytest
from models import assert_same_tokens, prompts, tiny

import hf_vkv  # noqa: F401
from hf_vkv.memory import KVCacheOutOfMemory
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError, process_mappings


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

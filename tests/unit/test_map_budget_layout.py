"""Rule 7 of :func:`hf_vkv.devices.choose_layout`: rows are limited by memory, never by mappings.
Where the CPU default (head-major, ~HEAD_MAJOR_SUBROW_MAPPINGS kernel mappings per (layer, K/V,
head) sub-row of a row) would need more mappings than the process has free, the rows get
token-major (a few per row); nothing else moves. The free mappings are given in the workload or
injected into the process's budget (``PROCESS_MAP_BUDGET.override``), never the machine's."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from hf_vkv import VKVCache
from hf_vkv.devices import (BEAM_TOKEN_MAJOR_MAX_PROMPT, HEAD_MAJOR_BEAM_SUBROW_MAPPINGS, HEAD_MAJOR_SUBROW_MAPPINGS,
                            Workload, WorkloadError, choose_layout, head_major_mappings, policy_for)
from hf_vkv.memory.errors import VKVError
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError, process_mappings

SMOLLM2_SUBROWS = 30 * 2 * 3  # 30 layers x K/V x 3 KV heads


def rule(asked=None, **workload):
    return choose_layout(asked, Workload(**workload))


def test_head_major_mappings_is_rows_times_subrows_times_the_measured_count():
    # measured: benchmarks/results/map_budget_step_2048x96_t1.json, map_budget_count.json
    assert (HEAD_MAJOR_SUBROW_MAPPINGS, HEAD_MAJOR_BEAM_SUBROW_MAPPINGS) == (3, 4)
    assert head_major_mappings(Workload(rows=128, subrows=SMOLLM2_SUBROWS)) == 128 * 180 * 3
    assert head_major_mappings(Workload(rows=128, subrows=SMOLLM2_SUBROWS, num_beams=4)) == 128 * 180 * 4
    assert head_major_mappings(Workload(rows=128)) is None
    assert head_major_mappings(Workload(subrows=SMOLLM2_SUBROWS)) is None


def test_cpu_rows_past_the_free_mappings_get_token_major_and_rows_within_keep_head_major():
    assert policy_for("cpu").layout == "head_major"
    need = 128 * SMOLLM2_SUBROWS * HEAD_MAJOR_SUBROW_MAPPINGS  # 69,120: n=128 of SmolLM2
    cpu = dict(device_type="cpu", subrows=SMOLLM2_SUBROWS)
    assert rule(rows=128, mappings_free=need, **cpu) == "head_major"  # exactly fits
    assert rule(rows=128, mappings_free=need - 1, **cpu) == "token_major"
    free = 56_406  # what the budget leaves vkv in a process that loaded SmolLM2 (vm.max_map_count 65530)
    assert rule(rows=8, mappings_free=free, **cpu) == "head_major"
    assert rule(rows=96, mappings_free=free, **cpu) == "head_major"  # measured: runs, 51,660 held; keeps its step
    assert rule(rows=104, mappings_free=free, **cpu) == "head_major"  # 56,160
    assert rule(rows=105, mappings_free=free, **cpu) == "token_major"  # 56,700
    assert rule(rows=128, mappings_free=free, **cpu) == "token_major"  # the n=128: MappingLimitError before
    assert rule(rows=256, mappings_free=free, **cpu) == "token_major"
    long_beams = dict(num_beams=4, prompt_tokens=BEAM_TOKEN_MAJOR_MAX_PROMPT + 1, **cpu)  # past rule 5
    assert rule(rows=78, mappings_free=free, **long_beams) == "head_major"  # 56,160
    assert rule(rows=79, mappings_free=free, **long_beams) == "token_major"  # 56,880
    assert rule(rows=1, mappings_free=0, **cpu) == "token_major"  # the process has none left at all
    # rows or sub-rows unknown (a cache made by hand without batch_size): the device's default
    assert rule(device_type="cpu", rows=None, subrows=SMOLLM2_SUBROWS, mappings_free=0) == "head_major"
    assert rule(device_type="cpu", rows=256, subrows=None, mappings_free=0) == "head_major"


def test_nothing_asked_or_inherited_is_the_only_case_it_decides():
    tight = dict(device_type="cpu", rows=256, subrows=SMOLLM2_SUBROWS, mappings_free=100)
    assert rule("head_major", **tight) == "head_major"  # the user's: past the limit, MappingLimitError names token-major
    assert rule("contiguous", **tight) == "head_major"  # "contiguous": the device's default, as rule 5 reads it
    with pytest.raises(MappingLimitError, match=r"PrefixStore\(model.config, cache_config=\{'layout': 'token_major'\}\)"):
        rule(inherited="contiguous", **tight)  # a store's rows share its entries' layout: refused before any prefill
    assert rule(inherited="contiguous", **{**tight, "rows": 1, "mappings_free": 540}) == "head_major"  # within: kept
    with pytest.raises(MappingLimitError, match="PrefixStore"):
        rule(inherited="head_major", **tight)  # a head-major store's own: the same
    assert rule(inherited="token_major", **tight) == "token_major"  # a token-major store's rows fit
    assert rule(inherited="contiguous", **{**tight, "device_type": "cuda"}) == policy_for("cuda").layout  # no map limit
    assert rule(compiling=True, **tight) == "static"
    assert rule(attention="vkv_paged", **tight) == "paged"
    assert rule(num_beams=4, prompt_tokens=BEAM_TOKEN_MAJOR_MAX_PROMPT, **tight) == "token_major"  # rule 5 first
    assert rule(**{**tight, "device_type": "cuda"}) == policy_for("cuda").layout  # CUDA VMM: no per-process map limit
    assert rule(**{**tight, "device_type": None}) is None  # not decided before the device is known


def test_the_free_mappings_default_to_the_process_budget():
    cpu = dict(device_type="cpu", rows=4, subrows=10)  # 120 mappings
    # the process's lines already count vkv's own: a limit of those + k leaves vkv k more
    with PROCESS_MAP_BUDGET.override(limit=process_mappings() + 400, headroom=0):
        assert rule(**cpu) == "head_major"
    with PROCESS_MAP_BUDGET.override(limit=process_mappings() + 100, headroom=0):
        assert rule(**cpu) == "token_major"


def test_a_cache_counts_its_sub_rows_from_the_config_and_its_rows_from_batch_size():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, vocab_size=32)
    cpu = Workload(device_type="cpu")  # generate passes the model's device; a cache made by hand decides later
    subrows = 3 * 2 * 2
    fits = process_mappings() + 10 * subrows * HEAD_MAJOR_SUBROW_MAPPINGS
    with PROCESS_MAP_BUDGET.override(limit=fits, headroom=0):
        assert VKVCache(config, batch_size=10, workload=cpu).layout == "head_major"
        assert VKVCache(config, batch_size=11, workload=cpu).layout == "token_major"
        assert VKVCache(config, batch_size=11, workload=cpu, layout="head_major").layout == "head_major"


@pytest.mark.parametrize("field, value", [("rows", 0), ("subrows", -3), ("num_beams", 0), ("rows", 2.0),
                                          ("rows", True)])
def test_a_workload_out_of_range_is_a_typed_error(field, value):
    with pytest.raises(WorkloadError, match=f"Workload.{field} must be a positive int") as info:
        Workload(**{field: value})
    assert isinstance(info.value, VKVError) and isinstance(info.value, ValueError)

"""Rule 7 of :func:`hf_vkv.devices.choose_layout`: rows are limited by memory, never by mappings.
Where the CPU default (head-major, ~HEAD_MAJOR_SUBROW_MAPPINGS kernel mappings per (layer, K/V,
head) sub-row of a row) would need more mappings than the process has free, the rows get
token-major (a few per row); nothing else moves. The free mappings are given in the workload or
injected into the process's budget (``PROCESS_MAP_BUDGET.override``), never the machine's."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from hf_vkv import VKVCache
from hf_vkv.devices import (BEAM_TOKEN_MAJOR_MAX_PROMPT, HEAD_MAJOR_BEAM_SUBROW_MAPPINGS, HEAD_MAJOR_SHARED_PROMPT_ROWS,
                            HEAD_MAJOR_SUBROW_MAPPINGS, UNKNOWN_NEW_TOKENS, Workload, WorkloadError, choose_layout,
                            head_major_mappings, head_major_written_pages, policy_for)
from hf_vkv.memory.errors import VKVError
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError, process_mappings

SMOLLM2_SUBROWS = 30 * 2 * 3  # 30 layers x K/V x 3 KV heads
FP32 = 64 * 4  # SmolLM2's item (head dim 64): 16 tokens a 4 KiB head-major page


def rule(asked=None, **workload):
    return choose_layout(asked, Workload(**workload))


def test_head_major_mappings_is_rows_times_subrows_times_the_measured_count():
    # measured: benchmarks/results/map_budget_step_2048x96_t1.json, map_budget_count.json and the
    # calls in docs/layouts.md#mappings
    assert (HEAD_MAJOR_SUBROW_MAPPINGS, HEAD_MAJOR_SHARED_PROMPT_ROWS, HEAD_MAJOR_BEAM_SUBROW_MAPPINGS) == (3, 4, 2)
    assert head_major_mappings(Workload(rows=128, subrows=SMOLLM2_SUBROWS)) == 128 * 180 * 3
    # rows sharing one prompt: up to 4 rows' worth of sub-rows more per prompt
    assert head_major_mappings(Workload(rows=128, subrows=SMOLLM2_SUBROWS, prompt_repeats=128)) == 128 * 180 * 3 + 180 * 4
    assert head_major_mappings(Workload(rows=128, subrows=SMOLLM2_SUBROWS, prompt_repeats=8)) == 128 * 180 * 3 + 16 * 180 * 4
    assert head_major_mappings(Workload(rows=128)) is None
    assert head_major_mappings(Workload(subrows=SMOLLM2_SUBROWS)) is None


def test_the_most_a_sub_row_holds_is_two_plus_one_per_page_it_writes():
    """Past its prompt's whole pages (one run) a sub-row writes ``ceil((P mod t + G) / t)`` pages,
    each at worst a mapping of its own, and the unmapped rest is one more; a change adds 2."""
    w = dict(rows=4, subrows=SMOLLM2_SUBROWS, item_bytes=FP32)  # 16 tokens a page
    assert head_major_written_pages(Workload(prompt_tokens=2048, new_tokens=16, **w)) == 1
    assert head_major_written_pages(Workload(prompt_tokens=2048, new_tokens=17, **w)) == 2
    assert head_major_written_pages(Workload(prompt_tokens=2053, new_tokens=11, **w)) == 1  # 5 + 11 tokens
    assert head_major_written_pages(Workload(prompt_tokens=2053, new_tokens=12, **w)) == 2
    assert head_major_written_pages(Workload(prompt_tokens=2048, new_tokens=300, **w)) == 19
    assert head_major_written_pages(Workload(prompt_tokens=None, new_tokens=16, **w)) == 2  # P mod t: t - 1
    assert head_major_written_pages(Workload(prompt_tokens=2048, **w)) == UNKNOWN_NEW_TOKENS // 16  # not known
    assert head_major_written_pages(Workload(rows=4, prompt_tokens=7, new_tokens=9)) == 9  # no item size: a token a page
    beams = dict(num_beams=4, prompt_tokens=2048, **w)
    assert head_major_mappings(Workload(new_tokens=16, **beams)) == 4 * 180 * 3 + 2
    assert head_major_mappings(Workload(new_tokens=300, **beams)) == 4 * 180 * 21 + 2
    assert head_major_mappings(Workload(**beams)) == 4 * 180 * (2 + UNKNOWN_NEW_TOKENS // 16) + 2
    # without beams, the lesser of that and the measured count (which the new tokens do not move)
    sampled = dict(prompt_tokens=2048, prompt_repeats=4, **w)
    assert head_major_mappings(Workload(new_tokens=6, **sampled)) == 4 * 180 * 3 + 2
    assert head_major_mappings(Workload(new_tokens=300, **sampled)) == 4 * 180 * 3 + 180 * 4
    assert head_major_mappings(Workload(**sampled)) == 4 * 180 * 3 + 180 * 4
    with pytest.raises(WorkloadError, match="new_tokens must be an int >= 0"):
        Workload(new_tokens=-1)
    assert head_major_mappings(Workload(new_tokens=0, **beams)) == 4 * 180 * 2 + 2


def test_beams_keep_head_major_only_where_every_page_they_write_fits():
    """Beam search fragments a head-major sub-row up to one mapping per page it writes (measured:
    48 layers x 8 KV heads, 16 beams of a 520-token prompt, 300 new tokens: MappingLimitError at
    step 126 where the rule had counted 4 a sub-row). So beams count their new tokens: head-major
    where every page fits, token-major where it might not, and token-major where the call's length
    is not known."""
    free = 56_406  # what the budget leaves vkv in a process that loaded SmolLM2 (vm.max_map_count 65530)
    long_beams = dict(device_type="cpu", subrows=SMOLLM2_SUBROWS, num_beams=4, item_bytes=FP32,
                      prompt_tokens=2048, mappings_free=free)  # past rule 5
    assert rule(rows=104, new_tokens=16, **long_beams) == "head_major"  # 56,162: 3 a sub-row
    assert rule(rows=105, new_tokens=16, **long_beams) == "token_major"
    assert rule(rows=14, new_tokens=300, **long_beams) == "head_major"  # 52,922: 21 a sub-row
    assert rule(rows=15, new_tokens=300, **long_beams) == "token_major"  # 56,702
    assert rule(rows=4, **long_beams) == "token_major"  # new tokens not known: UNKNOWN_NEW_TOKENS counted
    assert rule(rows=4, **{**long_beams, "mappings_free": 10**9}) == "head_major"  # (a raised vm.max_map_count)
    # the bug's shape: 48 layers x K/V x 8 KV heads, head dim 16 in float32 (64 tokens a page)
    repro = dict(device_type="cpu", subrows=48 * 2 * 8, num_beams=16, rows=16, item_bytes=16 * 4, prompt_tokens=520,
                 mappings_free=free)
    assert rule(new_tokens=300, **repro) == "token_major"  # 16 x 768 x 7 + 2 = 86,018
    assert rule(new_tokens=50, **repro) == "head_major"  # 16 x 768 x 3 + 2 = 36,866
    assert rule(**repro) == "token_major"  # generate's call today: its new tokens are not in the workload


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
    long_beams = dict(num_beams=4, prompt_tokens=BEAM_TOKEN_MAJOR_MAX_PROMPT + 1, item_bytes=FP32, new_tokens=16,
                      **cpu)  # past rule 5; 1 + 16 tokens: 2 pages a sub-row, 4 mappings
    assert rule(rows=78, mappings_free=free, **long_beams) == "head_major"  # 56,162
    assert rule(rows=79, mappings_free=free, **long_beams) == "token_major"  # 56,882
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


def test_a_stores_beam_rows_are_checked_for_their_first_step_where_the_calls_length_is_not_known():
    """A store's rows keep its layout (rule 4): counting UNKNOWN_NEW_TOKENS would refuse the store
    for every beam call, so where the call's length is not known its beam rows are checked for
    their first step (3 a sub-row here); where it is, for every page they will write."""
    beams = dict(device_type="cpu", inherited="contiguous", subrows=SMOLLM2_SUBROWS, rows=4, num_beams=4,
                 prompt_tokens=2048, item_bytes=FP32, mappings_free=4 * 180 * 3 + 2)
    assert rule(**beams) == "head_major"
    assert rule(new_tokens=16, **beams) == "head_major"
    with pytest.raises(MappingLimitError, match="PrefixStore"):
        rule(new_tokens=17, **beams)  # a second page a sub-row: 4 x 180 x 4 + 2


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

"""Rule 6 of :func:`hf_vkv.devices.choose_layout`: memory at the limit. Where head-major's partly
written pages (one a (layer, K/V, head) sub-row of every row, and a copy of a shared prompt's last
page) could hold more than MEMORY_LIMIT_SLACK over the physical limit of a call, for any number of
new tokens, and the prompt has at most MEMORY_LIMIT_MAX_PROMPT tokens (token-major's decode step is
slower on longer ones), the rows get token-major (at most two small pages a row); elsewhere
head-major stays."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_vkv.cache.layouts import HeadMajorLayout, TokenMajorLayout
from hf_vkv.devices import (BEAM_TOKEN_MAJOR_MAX_PROMPT, HEAD_MAJOR_PAGE_BYTES, MEMORY_LIMIT_MAX_PROMPT, MEMORY_LIMIT_SLACK,
                            TOKEN_MAJOR_PAGE_BYTES,
                            Workload, WorkloadError, choose_layout, head_major_excess, policy_for, subrow_item_bytes)

SMOLLM2_SUBROWS = 30 * 2 * 3
FP32, BF16 = 64 * 4, 64 * 2  # SmolLM2's item: head dim 64


def rule(asked=None, **workload):
    workload.setdefault("device_type", "cpu")
    workload.setdefault("subrows", SMOLLM2_SUBROWS)
    workload.setdefault("mappings_free", 10**9)  # rule 7 (mappings) out of the way
    return choose_layout(asked, Workload(**workload))


def sampled(n, prompt, item=FP32, **kw):
    return rule(rows=n, prompt_tokens=prompt, prompt_repeats=n, item_bytes=item, **kw)


def test_constants_and_page_sizes():
    assert MEMORY_LIMIT_SLACK == 0.03
    assert MEMORY_LIMIT_MAX_PROMPT == 512
    assert TOKEN_MAJOR_PAGE_BYTES == 4096 == HEAD_MAJOR_PAGE_BYTES
    assert TokenMajorLayout.page_bytes("host") == TOKEN_MAJOR_PAGE_BYTES
    assert HeadMajorLayout.page_bytes("host") == HEAD_MAJOR_PAGE_BYTES


def test_excess_is_the_worst_share_over_the_limit():
    # 16 tokens a page (fp32): a row strands at most 15 tokens a sub-row; limit >= P + rows tokens
    assert head_major_excess(Workload(rows=4, prompt_tokens=2048, prompt_repeats=4, item_bytes=FP32)) \
        == pytest.approx(4 * 15 / (2048 + 4))
    # a prompt off the page boundary: each row also copies the prompt's last page (P mod 16 tokens)
    assert head_major_excess(Workload(rows=4, prompt_tokens=2053, prompt_repeats=4, item_bytes=FP32)) \
        == pytest.approx(4 * (15 + 5) / (2053 + 4))
    # distinct prompts (no repeats): no copied tail, every prompt counted
    assert head_major_excess(Workload(rows=8, prompt_tokens=2053, prompt_repeats=1, item_bytes=FP32)) \
        == pytest.approx(8 * 15 / (8 * 2053 + 8))
    # bf16: 32 tokens a page
    assert head_major_excess(Workload(rows=1, prompt_tokens=2048, prompt_repeats=1, item_bytes=BF16)) \
        == pytest.approx(31 / 2049)
    for missing in ("rows", "prompt_tokens", "prompt_repeats", "item_bytes"):
        full = dict(rows=4, prompt_tokens=2048, prompt_repeats=4, item_bytes=FP32)
        full[missing] = None
        assert head_major_excess(Workload(**full)) is None


ALL = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@pytest.mark.parametrize("item, prompt, head_major_rows", [
    (FP32, 5, ()), (FP32, 128, ()), (FP32, 512, (1,)), (FP32, 513, ALL), (FP32, 2048, ALL),
    (BF16, 128, ()), (BF16, 512, ()), (BF16, 2048, ALL),
])
def test_sampling_grid(item, prompt, head_major_rows):
    for n in ALL:
        expected = "head_major" if n in head_major_rows else "token_major"
        assert sampled(n, prompt, item) == expected, (item, prompt, n)


def test_longer_prompts_keep_head_major_whatever_their_excess():
    # n=64 of 2048 tokens: head-major could strand 45 % over the limit, but token-major's step is
    # slower there (MEMORY_LIMIT_MAX_PROMPT): the rule leaves it to head-major
    long = MEMORY_LIMIT_MAX_PROMPT + 1
    assert head_major_excess(Workload(rows=64, prompt_tokens=long, prompt_repeats=64, item_bytes=FP32)) > 0.4
    assert sampled(64, long) == "head_major"
    assert sampled(64, MEMORY_LIMIT_MAX_PROMPT) == "token_major"


def test_beams_above_the_beam_rule():
    long = BEAM_TOKEN_MAJOR_MAX_PROMPT + 1
    assert rule(rows=4, num_beams=4, prompt_tokens=long, prompt_repeats=4, item_bytes=FP32) == "head_major"
    assert rule(rows=4, num_beams=4, prompt_tokens=2048, prompt_repeats=4, item_bytes=FP32) == "head_major"
    assert rule(rows=8, num_beams=8, prompt_tokens=2048, prompt_repeats=8, item_bytes=FP32) == "head_major"
    assert rule(rows=16, num_beams=16, prompt_tokens=BEAM_TOKEN_MAJOR_MAX_PROMPT, prompt_repeats=16,
                item_bytes=FP32) == "token_major"


def test_a_batch_of_distinct_long_prompts_keeps_head_major():
    assert rule(rows=8, prompt_tokens=2048, prompt_repeats=1, item_bytes=FP32) == "head_major"
    assert rule(rows=8, prompt_tokens=128, prompt_repeats=1, item_bytes=FP32) == "token_major"


def test_the_rule_only_moves_the_hosts_default():
    short = dict(rows=4, prompt_tokens=5, prompt_repeats=4, item_bytes=FP32)
    assert sampled(4, 5) == "token_major"
    assert rule("head_major", **short) == "head_major"  # asked: the user's
    assert rule("contiguous", **short) == policy_for("cpu").layout  # "contiguous" names the default itself
    assert rule(inherited="head_major", **short) == "head_major"  # a prefix store's memory
    assert rule(inherited="contiguous", **short) == policy_for("cpu").layout
    assert rule(compiling=True, **short) == "static"
    assert rule(attention="vkv_paged", **short) == "paged"
    assert rule(**{**short, "device_type": "cuda"}) == policy_for("cuda").layout
    # unknown item size or repeats (a cache made by hand): today's default
    assert rule(rows=4, prompt_tokens=5) == policy_for("cpu").layout
    assert rule(rows=4, prompt_tokens=5, prompt_repeats=4) == policy_for("cpu").layout


def test_item_bytes_from_the_config():
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert subrow_item_bytes(config, torch.float32) == FP32
    assert subrow_item_bytes(config, torch.bfloat16) == BF16
    config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    assert subrow_item_bytes(config, torch.float32) == 16 * 4


@pytest.mark.parametrize("field", ["prompt_repeats", "item_bytes"])
def test_workload_fields_are_checked(field):
    with pytest.raises(WorkloadError, match=f"Workload.{field} must be a positive int"):
        Workload(**{field: 0})

"""Rows are limited by memory, never by mappings: a ``generate`` whose rows' bytes fit but whose
head-major sub-rows would pass ``vm.max_map_count`` runs on the default options (the layout rule,
:func:`hf_vkv.devices.choose_layout` rule 7, gives it token-major) and gives DynamicCache's tokens
and logits (``torch.equal``, every step; the K/V of every layer too). The limit is injected (a few
hundred mappings above what the process holds), never the machine's."""

from __future__ import annotations

import gc

import pytest
import torch
from models import assert_same_tokens, prompts, tiny
from transformers import LogitsProcessor, LogitsProcessorList

import hf_vkv  # noqa: F401
from hf_vkv.ab import run_ab
from hf_vkv.devices import (BEAM_TOKEN_MAJOR_MAX_PROMPT, HEAD_MAJOR_SUBROW_MAPPINGS, MEMORY_LIMIT_MAX_PROMPT, Workload,
                            head_major_mappings)
from hf_vkv.generate import cache_kwarg
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError, process_mappings

pytestmark = pytest.mark.integration

ROWS = 24  # n=24 samples of one prompt
SUBROWS = 4 * 2 * 4  # 4 layers x K/V x 4 KV heads
# longer than rule 6 (memory at the limit) looks at, so that only the mappings decide the layout
PROMPT = MEMORY_LIMIT_MAX_PROMPT + 8


def _model():
    return tiny("llama", layers=4, kv_heads=4)


def _limit() -> int:
    """Room for ~400 more mappings: head-major's 24 rows hold >= 2 per sub-row (1,536; the rule
    counts 3: 2,304), token-major's a few per row."""
    gc.collect()
    return process_mappings() + 400  # its lines count vkv's own already


def test_many_rows_past_the_mapping_limit_generate_with_dynamic_caches_tokens_and_logits():
    model = _model()
    inputs = prompts(1, PROMPT)
    kwargs = dict(max_new_tokens=12, do_sample=True, num_return_sequences=ROWS, pad_token_id=0)
    assert ROWS * SUBROWS * HEAD_MAJOR_SUBROW_MAPPINGS > 400
    with PROCESS_MAP_BUDGET.override(limit=_limit(), headroom=0):
        with pytest.raises(MappingLimitError):  # the limit bites: head-major's rows do not fit
            model.generate(**inputs, cache_implementation="vkv", cache_config={"layout": "head_major"}, **kwargs)
        gc.collect()
        report = run_ab(model, inputs, **kwargs)  # default options, the cache built as generate builds it
        assert report.identical, report.first_divergence
        assert report.rows == ROWS and all(step.tokens_equal for step in report.steps)
        assert all(step.max_abs_logit_diff == 0.0 for step in report.steps)
        torch.manual_seed(7)
        out = model.generate(**inputs, cache_implementation="vkv", return_dict_in_generate=True, **kwargs)
        cache = out[cache_kwarg()]
        assert cache.layout == "token_major"
        stats = cache.stats()
        assert 0 < stats.mappings <= 3 * ROWS  # a few per row, not per (layer, K/V, head)
        assert stats.groups[0].shared_prompt_rows > 0  # prefill once: the rows share the prompt's pages
    torch.manual_seed(7)
    assert_same_tokens(model.generate(**inputs, **kwargs), out.sequences)  # DynamicCache, the same draws


def test_beams_whose_sub_rows_fragment_past_a_fixed_count_run_on_the_default_options():
    """Beam search over a prompt past rule 5's, default options: its reorders give a head-major
    row pages other rows wrote, so its sub-rows grow by up to one mapping per page they write (5.5
    a sub-row here at the end, against the 4 the rule counted under beams before). Before, the rule
    kept head-major (4 beams x 32 sub-rows x 4 = 512 fit the limit below) and the call raised
    ``MappingLimitError`` part-way through decoding (the same call on head-major below, at step
    ~120 of 250); now it counts every page the beams may write and gives them token-major, with
    DynamicCache's tokens."""
    model = _model()
    beams, new = 4, 250
    length = BEAM_TOKEN_MAJOR_MAX_PROMPT + 8  # 520 tokens: past rule 5 (short beams: token-major)
    inputs = prompts(1, length)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, num_beams=beams, do_sample=False, pad_token_id=0)
    reference = model.generate(**inputs, **kwargs)  # DynamicCache
    old_count = beams * SUBROWS * 4  # what the rule counted before
    item = model.config.head_dim * 4  # float32: 64 tokens a 4 KiB page
    room = old_count + 16
    steps = []

    class Steps(LogitsProcessor):
        def __call__(self, input_ids, scores):
            steps.append(input_ids.shape[1])
            return scores

    gc.collect()
    with PROCESS_MAP_BUDGET.override(limit=process_mappings() + room, headroom=0):
        with pytest.raises(MappingLimitError):  # head-major passes the old count part-way through
            model.generate(**inputs, cache_implementation="vkv", cache_config={"layout": "head_major"},
                           logits_processor=LogitsProcessorList([Steps()]), **kwargs)
        assert len(steps) > 1  # not at the first step: a count the rule makes before it must cover it
        gc.collect()
        out = model.generate(**inputs, cache_implementation="vkv", return_dict_in_generate=True, **kwargs)
        assert out[cache_kwarg()].layout == "token_major"
        # token-major's rows fragment under beams too (259 here), but by pages of whole rows (a page
        # holds 2 tokens of all 32 sub-rows here), not by pages of every sub-row
        assert out[cache_kwarg()].stats().mappings < room
    assert_same_tokens(reference, out.sequences)
    # the count behind it: every page the beams may write, once generate passes the call's length
    # (Workload.new_tokens; until then beams count UNKNOWN_NEW_TOKENS)
    bound = head_major_mappings(Workload(rows=beams, subrows=SUBROWS, num_beams=beams, prompt_tokens=length,
                                         item_bytes=item, new_tokens=new))
    assert bound == beams * SUBROWS * (2 + 5) + 2 > room  # (520 mod 64 + 250) / 64: 5 pages written a sub-row


def test_rows_within_the_mapping_limit_keep_head_major():
    model = _model()
    out = model.generate(**prompts(1, PROMPT), max_new_tokens=4, do_sample=True, num_return_sequences=4, pad_token_id=0,
                         cache_implementation="vkv", return_dict_in_generate=True)
    cache = out[cache_kwarg()]
    assert cache.layout == "head_major"
    assert cache.stats().mappings >= 4 * SUBROWS  # one run (at least) per sub-row of every row


def test_a_default_prefix_stores_rows_past_the_limit_run_without_it_and_its_report_names_the_stores_option():
    """A store's rows take its entries' layout (rule 4), so rule 7 cannot switch them to
    token-major; rows that would pass the mapping limit in the default (head-major) store run
    without it (token-major, prefill once), with DynamicCache's tokens, and the call's reuse report
    says why and names the store's option; nothing goes into the store. A token-major store runs
    the same rows with reuse."""
    model = _model()
    inputs = prompts(1, 64)  # (a store's rows reserve the model's positions; rules 5-7 never see its calls)
    kwargs = dict(max_new_tokens=4, do_sample=True, num_return_sequences=ROWS, pad_token_id=0)
    store = hf_vkv.PrefixStore(model.config)
    with PROCESS_MAP_BUDGET.override(limit=_limit(), headroom=0):
        torch.manual_seed(7)
        out = model.generate(**inputs, cache_implementation="vkv", cache_config={"prefix_store": store},
                             return_dict_in_generate=True, **kwargs)
        report = hf_vkv.reuse_report(out)
        assert "PrefixStore(model.config, cache_config={'layout': 'token_major'})" in report.refusal
        assert out[cache_kwarg()].layout == "token_major" and len(store) == 0 and report.inserted == 0
        store.check_invariants()
        token_major = hf_vkv.PrefixStore(model.config, cache_config={"layout": "token_major"})
        torch.manual_seed(7)
        again = model.generate(**inputs, cache_implementation="vkv", cache_config={"prefix_store": token_major},
                               return_dict_in_generate=True, **kwargs)
        assert hf_vkv.reuse_report(again).refusal is None and len(token_major) >= 1  # its rows went in
    torch.manual_seed(7)
    reference = model.generate(**inputs, **kwargs)
    assert_same_tokens(reference, out.sequences)
    assert_same_tokens(reference, again.sequences)
    token_major.check_invariants()

"""The layout is decided in one function, :func:`hf_vkv.devices.choose_layout`: what
``cache_config`` names, else static when compiling, paged under "vkv_paged", a prefix store's,
token-major for CPU beam search with short prompts (measured: benchmarks/beam_layout_cpu.py), the
device's default otherwise."""

from __future__ import annotations

import pytest

import hf_vkv
from hf_vkv.ab import run_ab
from hf_vkv.devices import BEAM_TOKEN_MAJOR_MAX_PROMPT
from hf_vkv.devices import Workload, choose_layout, policy_for
from hf_vkv.memory.errors import CacheOptionError
from hf_vkv.generate import cache_kwarg
from models import assert_same_tokens, prompts, tiny

pytestmark = pytest.mark.integration


def test_the_rule() -> None:
    short, long = BEAM_TOKEN_MAJOR_MAX_PROMPT, BEAM_TOKEN_MAJOR_MAX_PROMPT + 1
    cpu = policy_for("cpu").layout

    def rule(asked=None, **workload):
        return choose_layout(asked, Workload(**workload))

    assert rule(device_type="cpu", num_beams=4, prompt_tokens=short) == "token_major"
    assert rule(device_type="cpu", num_beams=4, prompt_tokens=long) == cpu
    assert rule(device_type="cpu", num_beams=1, prompt_tokens=short) == cpu
    assert rule(device_type="cpu", num_beams=4, prompt_tokens=None) == cpu
    assert rule(device_type="cuda", num_beams=4, prompt_tokens=short) == policy_for("cuda").layout
    assert rule(device_type=None) is None  # a cache made by hand decides at its first update
    assert rule("head_major", device_type="cpu", num_beams=4, prompt_tokens=short) == "head_major"
    assert rule("contiguous", device_type="cpu", num_beams=4, prompt_tokens=short) == cpu
    assert rule(device_type="cpu", compiling=True) == "static"
    assert rule(device_type="cpu", attention="vkv_paged", num_beams=4, prompt_tokens=short) == "paged"
    assert rule(device_type="cpu", inherited="contiguous", num_beams=4, prompt_tokens=short) == cpu
    assert rule(device_type="cpu", inherited="token_major") == "token_major"
    with pytest.raises(CacheOptionError, match="vkv_paged"):
        rule("paged", device_type="cpu", attention="sdpa")


def _generate(**kwargs):
    model = tiny("llama")
    return model.generate(**prompts(2, 8), max_new_tokens=4, cache_implementation="vkv",
                          return_dict_in_generate=True, **kwargs)


def test_generate_applies_it_unless_a_layout_is_given() -> None:
    ref = tiny("llama").generate(**prompts(2, 8), max_new_tokens=4, num_beams=3, return_dict_in_generate=True)
    beams = _generate(num_beams=3)
    assert beams[cache_kwarg()].layout == "token_major"
    assert_same_tokens(ref.sequences, beams.sequences)
    assert _generate(num_beams=3, cache_config={"layout": "head_major"})[cache_kwarg()].layout == "head_major"
    # greedy on 8-token prompts: head-major's 64-token pages (tiny llama) would strand far more than
    # MEMORY_LIMIT_SLACK of the KV (rule 6, tests/unit/test_memory_limit_rule.py): token-major
    assert _generate()[cache_kwarg()].layout == "token_major"
    assert _generate(cache_config={"layout": "contiguous"})[cache_kwarg()].layout == policy_for("cpu").layout
    report = run_ab(tiny("llama"), prompts(1, 8), max_new_tokens=3, num_beams=2)  # the harness builds it the same way
    assert report.identical and report.layout in ("contiguous",)
    cache = hf_vkv.VKVCache.for_generate(tiny("llama"), batch_size=1, expand=2, max_length=12, cache_config=None,
                                         num_beams=2, prompt_tokens=8)
    assert cache.layout == "token_major"

"""The ``"vkv_cascade"`` attention in ``generate``: a shared prefix read once per decode step.

It reorders float sums, so the oracle is: tokens identical to DynamicCache's and float32 logits
within 1e-4 (the measured maximum is reported by the A/B harness; half precision takes sdpa's
path unless ``cache_config={"cascade_half_precision": True}``). Tiny models hold at most 256
positions, so the crossover (``CASCADE_MIN_SHARED_TOKENS``) is lowered here to make every shared
prefix count; tests keep the real one (or one per rows) and check that the plain path then runs,
with the reason in ``stats().cascade``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch

import hf_vkv.attention.cascade as cascade_module
import hf_vkv.devices as devices_module
from hf_vkv.ab import run_ab
from hf_vkv.ab.table import format_report
from models import SMALL_PAGE, assert_same_tokens, prompts, tiny

pytestmark = pytest.mark.integration

BOUND = 1e-4
NEW = 8


@contextlib.contextmanager
def cascade(model, *, min_shared: dict[int, dict[int, int | None]] | None = {1: {2: 1}}) -> Iterator[list[int]]:
    """The model's attention is "vkv_cascade" inside; yields a list that counts cascade decodes."""
    calls: list[int] = []
    real = cascade_module.cascade_decode

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    before, threshold = model.config._attn_implementation, devices_module.CASCADE_MIN_SHARED_TOKENS
    cascade_module.cascade_decode = counted
    if min_shared is not None:
        devices_module.CASCADE_MIN_SHARED_TOKENS = min_shared
    model.set_attn_implementation("vkv_cascade")
    try:
        yield calls
    finally:
        model.set_attn_implementation(before)
        cascade_module.cascade_decode = real
        devices_module.CASCADE_MIN_SHARED_TOKENS = threshold


def _run(model, inputs, layout: str, *, min_shared: dict[int, dict[int, int | None]] | None = {1: {2: 1}}, **kwargs):
    kwargs = dict(max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True, **kwargs)
    torch.manual_seed(0)
    ref = model.generate(**inputs, **kwargs)
    with cascade(model, min_shared=min_shared) as calls:
        torch.manual_seed(0)
        got = model.generate(**inputs, cache_implementation="vkv",
                             cache_config={"layout": layout, "page_bytes": SMALL_PAGE}, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    got.past_key_values.check_invariants()
    return diff, len(calls), got


MODES = {
    "beam": dict(num_beams=4, do_sample=False),
    "sample": dict(do_sample=True, num_return_sequences=4),
}


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("arch, kv_heads, attn", [("llama", None, "sdpa"), ("llama", 4, "eager"),
                                                  ("gpt2", None, "sdpa"), ("qwen2", None, "eager")])
def test_shared_prefix_is_read_once_with_identical_tokens(mode: str, layout: str, arch: str, kv_heads: int | None,
                                                          attn: str) -> None:
    model = tiny(arch, attn=attn, kv_heads=kv_heads) if kv_heads else tiny(arch, attn=attn)
    inputs = prompts(2, 150, seed=3, left_pad=[0, 7])  # over two head-major pages of shared prompt, left-padded
    diff, calls, _ = _run(model, inputs, layout, **MODES[mode])
    assert calls == (NEW - 1) * 2  # every decode step, both layers
    assert diff <= BOUND


def test_sliding_layers_stay_on_the_plain_path() -> None:
    # mistral: every layer slides (exact, nothing tagged); gemma3: its full-attention layer is tagged
    diff, calls, _ = _run(tiny("mistral"), prompts(1, 150, seed=2), "head_major", **MODES["sample"])
    assert (calls, diff) == (0, 0.0)
    diff, calls, _ = _run(tiny("gemma3"), prompts(1, 150, seed=2), "head_major", **MODES["sample"])
    assert calls == NEW - 1 and diff <= BOUND


@pytest.mark.threads(1, 2)
def test_below_the_crossover_the_plain_path_runs_exactly() -> None:
    """The measured table: 4 beams sharing at most 150 tokens stay on sdpa (DynamicCache's logits
    exactly), and ``stats()`` says why."""
    diff, calls, got = _run(tiny("llama"), prompts(1, 150, seed=4), "head_major", min_shared=None, **MODES["beam"])
    threads = torch.get_num_threads()
    least = devices_module.CASCADE_MIN_SHARED_TOKENS[max(t for t in devices_module.CASCADE_MIN_SHARED_TOKENS
                                                          if t <= threads)][4]
    assert least is None or least > 150
    assert (calls, diff) == (0, 0.0)
    reason = got.past_key_values.stats().cascade
    shared = int(reason.removeprefix("sdpa: 4 rows share ").split()[0])
    assert 0 < shared <= 150
    assert reason == devices_module.cascade_refusal(shared_tokens=shared, rows=4, threads=threads)


@pytest.mark.threads(1, 2)
def test_the_crossover_is_per_rows() -> None:
    """A table whose 4-row entry is out of reach but whose 2-row entry is 1: 3 beams (3 rows take
    the 2-row entry) read their prefix once, 4 beams do not, with the reason in ``stats()``."""
    table = {1: {2: 1, 4: 10 ** 9}}
    model, inputs = tiny("llama"), prompts(1, 150, seed=4)
    diff, calls, got = _run(model, inputs, "head_major", min_shared=table, num_beams=3, do_sample=False)
    assert calls == (NEW - 1) * 2 and diff <= BOUND and got.past_key_values.stats().cascade == "on"
    diff, calls, got = _run(model, inputs, "head_major", min_shared=table, **MODES["beam"])
    assert (calls, diff) == (0, 0.0)
    assert "pays for 4+ rows from 1000000000 shared tokens" in got.past_key_values.stats().cascade


def test_a_model_that_rebuilds_its_keys_says_no_attention_read_the_prefix() -> None:
    """Multi-head latent attention expands the cached latents into keys after the cache update: its
    attention never gets a tagged key, so it runs sdpa's path (exactly), and ``stats()`` says so
    (it said "on")."""
    import breadth_models

    spec = breadth_models.SPECS["deepseek_v3"]  # room for 150 tokens: full pages the rows share
    model = breadth_models._seeded_build(dataclasses.replace(spec, kwargs={**spec.kwargs, "max_position_embeddings": 256}),
                                         None).eval()
    diff, calls, got = _run(model, breadth_models.prompts(1, 150, seed=2), "head_major", **MODES["sample"])
    assert (calls, diff) == (0, 0.0)
    assert "no layer's attention read them once" in got.past_key_values.stats().cascade


def test_rows_that_share_no_page_say_so() -> None:
    """Greedy rows of different prompts share nothing: ``stats()`` says so (it said "on")."""
    diff, calls, got = _run(tiny("llama"), prompts(2, 150, seed=5), "head_major", do_sample=False)
    assert (calls, diff) == (0, 0.0)
    assert got.past_key_values.stats().cascade == "sdpa: no rows of the last step hold their first tokens on the same pages"


def test_greedy_rows_share_nothing() -> None:
    diff, calls, _ = _run(tiny("llama"), prompts(2, 150, seed=5), "head_major", do_sample=False)
    assert (calls, diff) == (0, 0.0)


def test_ab_harness_reports_the_cascade(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices_module, "CASCADE_MIN_SHARED_TOKENS", {1: {2: 1}})
    model = tiny("llama")
    report = run_ab(model, prompts(1, 150, seed=6), max_new_tokens=NEW, layout="cascade", tee=False,
                    cache_config={"page_bytes": SMALL_PAGE}, num_beams=3, do_sample=False)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert report.layout == "cascade" and report.tokens_identical and report.passed
    assert 0.0 < report.max_abs_logit_diff <= BOUND  # the sums were reordered, within the bound
    assert not report.identical
    assert report.to_dict()["layout"] == "cascade"
    assert report.logit_bound == BOUND and report.within_bound  # float32's bound, checked per dtype
    # the same run over its dtype's bound, or in a dtype with no bound, is reported as such: never passed
    over = dataclasses.replace(report, steps=tuple(dataclasses.replace(s, max_abs_logit_diff=2 * BOUND)
                                                   if s.max_abs_logit_diff else s for s in report.steps))
    assert not over.within_bound and not over.passed and "OVER its float32 bound" in format_report(over)
    for dtype, bound in (("bfloat16", 2 ** -4), ("float16", 2 ** -7), ("float64", None)):
        other = dataclasses.replace(report, environment={**report.environment, "dtype": dtype})
        assert other.logit_bound == bound and other.passed == (bound is not None)


def test_the_cache_tags_for_the_attention_it_was_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tagging is chosen once, when the cache is built: a cache made before the model switched to
    the cascade reads with sdpa's path (exact, no cascade call, ``stats().cascade`` not asked); one
    made after tags, and keeps the tokens."""
    import hf_vkv

    monkeypatch.setattr(devices_module, "CASCADE_MIN_SHARED_TOKENS", {1: {2: 1}})
    model = tiny("llama")
    inputs = prompts(1, 150, seed=7)
    before = hf_vkv.VKVCache.for_generate(model, batch_size=1, expand=3, max_length=160,
                                          cache_config={"page_bytes": SMALL_PAGE})
    ref = model.generate(**inputs, max_new_tokens=4, num_beams=3, do_sample=False)
    with cascade(model) as calls:
        got = model.generate(**inputs, max_new_tokens=4, num_beams=3, do_sample=False,
                             **{hf_vkv.generate.cache_kwarg(): before})
        assert_same_tokens(ref, got)
        assert len(calls) == 0 and before.stats().cascade == "not asked"
        after = hf_vkv.VKVCache.for_generate(model, batch_size=1, expand=3, max_length=160,
                                             cache_config={"page_bytes": SMALL_PAGE})
        got = model.generate(**inputs, max_new_tokens=4, num_beams=3, do_sample=False,
                             **{hf_vkv.generate.cache_kwarg(): after})
    assert_same_tokens(ref, got)
    assert len(calls) == 3 * 2 and after.stats().cascade == "on"


@pytest.mark.threads(1, 2)
def test_half_precision_takes_sdpa_unless_asked_by_name() -> None:
    """bfloat16 / float16 caches do not tag shared prefixes (sdpa runs: DynamicCache's logits
    exactly), with the reason in ``stats().cascade``; ``cascade_half_precision`` asks for the cascade."""
    model = copy.deepcopy(tiny("llama")).to(torch.bfloat16)  # the shared tiny model stays float32
    inputs = prompts(1, 150, seed=7)
    diff, calls, got = _run(model, inputs, "head_major", **MODES["sample"])
    assert (calls, diff) == (0, 0.0)
    assert got.past_key_values.stats().cascade.startswith("sdpa: the cascade can change tokens in bfloat16")
    with cascade(model) as asked:
        torch.manual_seed(0)
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=True, num_return_sequences=4,
                             return_dict_in_generate=True, cache_implementation="vkv",
                             cache_config={"page_bytes": SMALL_PAGE, "cascade_half_precision": True})
    assert len(asked) > 0 and out.past_key_values.stats().cascade == "on"

"""Breadth: every architecture of ``breadth_models`` in every generation mode, against DynamicCache.

For each (architecture, mode) the table :data:`EXPECT` says what must happen:

* ``IDENTICAL``: ``generate`` with ``cache_implementation="vkv"`` gives the very tokens (and
  logits / beam scores) of the default ``DynamicCache`` with the model's own attention, and the
  ``VKVCache`` stores every layer that keeps K/V (full, sliding, chunked, the attention part of
  hybrids, MLA); linear/recurrent state stays with transformers;
* :func:`refused`: a typed hf_vkv error, asserted by class and a key phrase, raised when the model
  is built with / switched to ``attn_implementation="vkv_paged"`` (before any forward);
* :func:`cache_xfail`: what ``IDENTICAL`` asserts, known to fail today because of the cache
  (``xfail(strict=True)``: the cache fix must remove the mark).

Modes: ``greedy`` (a left-padded batch of 2, logits compared), ``beams`` (4 beams, 2 returned,
scores compared), ``sample`` (seeded, ``num_return_sequences=3``), ``paged_greedy`` and
``paged_beams`` (the VKV run under ``attn_implementation="vkv_paged"``, the paged layout).
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from breadth_models import SPECS, ArchitectureMissing, build_with_attention, prompts, tiny
from transformers.cache_utils import EncoderDecoderCache, get_layer_types_and_kwargs

import hf_vkv
from hf_vkv.devices import Workload, choose_layout
from hf_vkv.attention import UnsupportedModelError

pytestmark = pytest.mark.integration

NEW = 8  # new tokens: past the sliding windows (6) of the windowed architectures
PAGED = "vkv_paged"
KV_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")

GENERATE: dict[str, dict[str, Any]] = {
    "greedy": dict(do_sample=False, output_logits=True),
    "beams": dict(do_sample=False, num_beams=4, num_return_sequences=2, output_scores=True, output_logits=True),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0, output_logits=True),
}
MODES = ("greedy", "beams", "sample", "paged_greedy", "paged_beams")


@dataclass(frozen=True)
class Expect:
    """What one (architecture, mode) must do."""

    error: type[Exception] | None = None  # None: identical to DynamicCache
    phrase: str = ""  # a key phrase of the error's message
    xfail: str = ""  # a known cache-side failure: "cache: <one line>"
    raises: type[Exception] = AssertionError  # how that failure shows today (any other exception fails the test)


IDENTICAL = Expect()


def refused(error: type[Exception], phrase: str) -> Expect:
    return Expect(error=error, phrase=phrase)


def cache_xfail(reason: str, raises: type[Exception] = AssertionError) -> Expect:
    return Expect(xfail=f"cache: {reason}", raises=raises)


_OWN_ATTENTION = refused(UnsupportedModelError, "does not call transformers' AttentionInterface")
_PAGED_REFUSALS = {
    "gemma2": refused(UnsupportedModelError, "softcapping"),
    "gpt_oss": refused(UnsupportedModelError, "attention sinks (s_aux)"),
    "deepseek_v4": refused(UnsupportedModelError, "attention sinks (s_aux)"),
    "vaultgemma": refused(UnsupportedModelError, "softcapping"),
    **{arch: _OWN_ATTENTION for arch in ("mpt", "bloom", "codegen", "gptj", "falcon", "gpt_neo", "xglm", "fsmt",
                                         "prophetnet")},
}


def _calls_attention_interface(arch: str) -> bool:
    """Whether the installed transformers' modeling code of ``arch`` calls the attention interface
    (transformers 5.24 moved CodeGen and GPT-J onto it; 5.17 had their own attention code)."""
    cls = getattr(transformers, SPECS[arch].model, None)
    if cls is None:
        return False
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[cls.__module__])


def _table() -> dict[tuple[str, str], Expect]:
    table = {(arch, mode): IDENTICAL for arch in SPECS for mode in MODES}
    for arch, expect in _PAGED_REFUSALS.items():
        if expect is _OWN_ATTENTION and _calls_attention_interface(arch):
            continue  # served by "vkv_paged" on this transformers: identical, like the others
        table[arch, "paged_greedy"] = table[arch, "paged_beams"] = expect
    return table


#: (architecture, mode) -> what must happen. Read top to bottom: identical unless listed above.
EXPECT = _table()


# ------------------------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second intra-op thread on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(arch: str) -> Any:
    try:
        return tiny(arch)
    except ArchitectureMissing as missing:
        pytest.skip(str(missing))


def _generate(model: Any, kind: str, **extra: Any) -> Any:
    torch.manual_seed(7)
    return model.generate(**prompts(), max_new_tokens=NEW, return_dict_in_generate=True, **GENERATE[kind], **extra)


_REFERENCES: dict[tuple[str, str], Any] = {}


def _reference(arch: str, kind: str) -> Any:
    """DynamicCache with the model's own attention (computed once per architecture and kind)."""
    if (arch, kind) not in _REFERENCES:
        _REFERENCES[arch, kind] = _generate(_model(arch), kind)
    return _REFERENCES[arch, kind]


def kv_layers(model: Any) -> int:
    """Layers of ``model`` whose cache keeps per-token K/V (what VKVCache must store)."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return sum(kind in KV_LAYER_KINDS for kind in types)


def stored_layers(cache: hf_vkv.VKVCache) -> int:
    return sum(len(group.members) for group in cache.groups)


def assert_identical(ref: Any, got: Any, kind: str) -> None:
    assert torch.equal(ref.sequences, got.sequences), f"tokens differ:\n{ref.sequences}\n{got.sequences}"
    for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}: max |diff| {(a - b).abs().max().item()}"
    if kind == "beams":
        assert torch.equal(ref.sequences_scores, got.sequences_scores)
        for step, (a, b) in enumerate(zip(ref.scores, got.scores, strict=True)):
            assert torch.equal(a, b), f"beam scores differ at step {step}"


def assert_cache_holds_kv(model: Any, past: Any, *, paged: bool, num_beams: int = 1) -> None:
    """The returned cache is a VKVCache that stores every K/V layer of the model, paged under the
    paged attention, else in one of the CPU's contiguous layouts (which one is the layout rule's
    to say for the workload: ``tests/unit/test_memory_limit_rule.py``, ``test_workload_layout.py``)."""
    if isinstance(past, EncoderDecoderCache):
        past = past.self_attention_cache
    assert isinstance(past, hf_vkv.VKVCache), f"generate returned {type(past).__name__}, not a VKVCache"
    contiguous = {choose_layout(None, Workload(device_type="cpu", num_beams=num_beams, prompt_tokens=1)), "token_major"}
    assert (past.layout == "paged") if paged else (past.layout in contiguous), past.layout
    assert stored_layers(past) == kv_layers(model), (
        f"VKVCache stores {stored_layers(past)} of the model's {kv_layers(model)} K/V layers")
    past.check_invariants()


def _run_identical(arch: str, mode: str) -> None:
    model = _model(arch)
    paged = mode.startswith("paged_")
    kind = mode.removeprefix("paged_")
    ref = _reference(arch, kind)
    before = model.config._attn_implementation
    if paged:
        model.set_attn_implementation(PAGED)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _generate(model, kind, cache_implementation="vkv",
                            **({"cache_config": {"block_tokens": 4}} if paged else {}))
    finally:
        if paged:
            model.set_attn_implementation(before)
    assert_identical(ref, got, kind)
    if kv_layers(model):
        assert_cache_holds_kv(model, got.past_key_values, paged=paged, num_beams=GENERATE[kind].get("num_beams", 1))
    else:  # no K/V to store: one clear hf_vkv warning naming the model's layer kinds, and transformers' own cache
        assert not isinstance(got.past_key_values, hf_vkv.VKVCache)
        said = [str(w.message) for w in caught if "vkv" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in caught]
        kinds = hf_vkv.VKVCache.layer_kinds(model.config)
        assert kinds and all(kind in said[0] for kind in kinds), (kinds, said[0])


def _run_refused(arch: str, expect: Expect, attention: str = PAGED) -> None:
    assert expect.error is not None
    # at construction (what from_pretrained(attn_implementation="vkv_paged") runs) ...
    try:
        with pytest.raises(expect.error, match=re.escape(expect.phrase)) as built:
            build_with_attention(arch, attention)
    except ArchitectureMissing as missing:
        pytest.skip(str(missing))
    # ... and when an existing model is switched, which then keeps its attention
    model = _model(arch)
    assert f"model type {model.config.model_type!r}" in str(built.value) and repr(attention) in str(built.value)
    before = model.config._attn_implementation
    with pytest.raises(expect.error, match=re.escape(expect.phrase)):
        model.set_attn_implementation(attention)
    assert model.config._attn_implementation == before


def _cases() -> Iterator[Any]:
    for (arch, mode), expect in EXPECT.items():
        marks = [pytest.mark.xfail(strict=True, reason=expect.xfail, raises=expect.raises)] if expect.xfail else []
        yield pytest.param(arch, mode, expect, id=f"{arch}-{mode}", marks=marks)


@pytest.mark.parametrize(("arch", "mode", "expect"), list(_cases()))
def test_breadth(arch: str, mode: str, expect: Expect) -> None:
    if expect.error is None:
        _run_identical(arch, mode)
    else:
        _run_refused(arch, expect)


@pytest.mark.parametrize("arch", sorted(_PAGED_REFUSALS))
def test_the_cascade_refuses_what_the_paged_attention_refuses(arch: str) -> None:
    """``"vkv_cascade"`` computes sdpa's attention too: a model with attention code of its own (its
    attention would never call the cascade: GPT-Neo raised a raw KeyError, Bloom and XGLM loaded and
    never ran it), sinks or softcapping is refused at construction and when switched, as by
    ``"vkv_paged"``."""
    expect = _PAGED_REFUSALS[arch]
    if expect is _OWN_ATTENTION and _calls_attention_interface(arch):
        pytest.skip(f"{arch} calls the attention interface on this transformers: served")
    _run_refused(arch, expect, "vkv_cascade")


def test_table_is_broad() -> None:
    """At least 35 architectures, each in every mode, and the families the issue names."""
    assert len(SPECS) >= 35
    assert {mode for _, mode in EXPECT} == set(MODES)
    named = {"gpt_oss", "t5", "mpt", "gemma2", "gptj", "falcon", "gpt_neo", "bloom", "codegen", "mamba", "bart",
             "falcon_h1", "zamba2", "jamba", "lfm2", "qwen3_next", "deepseek_v3", "llama", "qwen2", "mistral",
             "gemma", "phi", "gpt2"}
    assert named <= set(SPECS)
    assert any(spec.encoder_decoder for spec in SPECS.values())


def test_a_model_whose_generate_takes_no_cache_gets_one_warning_and_its_own_cache() -> None:
    """MiniMax (Text-01) builds its own ``MiniMaxCache``, and transformers' generate takes no other:
    "vkv" cannot be honoured, so the call says so (naming a prefix store given too, which goes
    unused) and generates exactly as without it."""
    from breadth_models import _HD16, Spec, _seeded_build

    try:
        model = _seeded_build(Spec("MiniMaxForCausalLM", "MiniMaxConfig", _HD16), None).eval()
    except ArchitectureMissing as missing:
        pytest.skip(str(missing))
    model.generation_config.pad_token_id = model.config.pad_token_id
    ref = model.generate(**prompts(), max_new_tokens=NEW, return_dict_in_generate=True, **GENERATE["greedy"])
    for extra, store_named in (({}, False), ({"cache_config": {"prefix_store": hf_vkv.PrefixStore(model.config)}}, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model.generate(**prompts(), max_new_tokens=NEW, return_dict_in_generate=True, **GENERATE["greedy"],
                                 cache_implementation="vkv", **extra)
        said = [str(w.message) for w in caught if "vkv" in str(w.message)]
        assert len(said) == 1 and "takes no Cache object" in said[0], said
        assert ("prefix store" in said[0]) == store_named, said[0]
        assert not isinstance(got.past_key_values, hf_vkv.VKVCache)
        assert_identical(ref, got, "greedy")


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba"])
def test_a_model_without_kv_layers_names_the_unused_store(arch: str) -> None:
    """A model whose layers keep no K/V vkv stores (Mamba) generates with transformers' own cache,
    exactly as without "vkv"; its one warning says why, and names a prefix store given as unused
    (``reuse_report`` has nothing to say for a cache vkv did not make)."""
    model = _model(arch)
    ref = _generate(model, "greedy")
    store = hf_vkv.PrefixStore(model.config)
    for extra, store_named in (({}, False), ({"cache_config": {"prefix_store": store}}, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _generate(model, "greedy", cache_implementation="vkv", **extra)
        said = [str(w.message) for w in caught if "vkv" in str(w.message)]
        assert len(said) == 1 and "keeps no key/value states" in said[0], said
        assert ("without the prefix store" in said[0]) == store_named, said[0]
        assert hf_vkv.reuse_report(got) is None
        assert_identical(ref, got, "greedy")
    assert store.stats().lookups == 0 and store.stats().entries == 0

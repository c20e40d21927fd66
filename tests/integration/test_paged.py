"""The paged layout's own contract (token identity in every generate mode runs in
``test_generate_ab.py`` and ``test_tee.py``, which cover both layouts).

* the layout follows the attention implementation, and asking for ``layout="paged"`` on a model
  whose attention cannot read it is a clear error;
* ``from_pretrained(..., attn_implementation="vkv_paged")`` and ``pipeline`` work unchanged;
* the attention reads the blocks in place: reorders and copy-on-write never move more than the
  partly written tail block of a row;
* with untagged K/V (any other cache) ``"vkv_paged"`` computes exactly as sdpa;
* the fused kernel (sums ordered otherwise than sdpa's) runs only where the cache asked for it
  (``paged_kernel="fused"``) and only on CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import SMALL_PAGE, assert_same_tokens, prompts, tiny, tokenizer, words
from transformers import AutoModelForCausalLM, pipeline
from transformers.cache_utils import DynamicCache

from hf_vkv import CacheOptionError, VKVCache
from hf_vkv.devices import policy_for
from hf_vkv.attention import KV_TAG
from hf_vkv.attention.paged import reads_in_place, vkv_paged_attention
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration


def test_layout_follows_the_attention_implementation(tmp_path: Any) -> None:
    tiny("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="vkv_paged")
    assert model.config._attn_implementation == "vkv_paged"
    cache = VKVCache(model.config)
    assert cache.layout == "paged"
    assert VKVCache(model.config, layout="token_major").layout == "token_major"
    default = VKVCache(tiny("llama").config)
    assert default.layout is None  # the device's default, chosen at the first update
    default.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    assert default.layout == policy_for("cpu").layout


def test_paged_layout_needs_the_paged_attention() -> None:
    with pytest.raises(ValueError, match="attn_implementation='vkv_paged'"):
        VKVCache(tiny("llama").config, layout="paged")
    with pytest.raises(ValueError, match="block_tokens"):
        VKVCache(tiny("llama").config, block_tokens=0)
    with pytest.raises(ValueError, match="layout"):
        VKVCache(tiny("llama").config, layout="ring")
    model = tiny("llama")
    model.set_attn_implementation("vkv_paged")
    try:
        assert VKVCache(model.config, layout="head_major").layout == "head_major"  # an explicit contiguous layout
    finally:
        model.set_attn_implementation("sdpa")


def test_from_pretrained_and_pipeline(tmp_path: Any) -> None:
    tiny("qwen2").save_pretrained(tmp_path)
    tok = tokenizer()
    texts = [words(torch.arange(10, 19)), words(torch.arange(40, 44)), words(torch.arange(100, 113))]
    out = {}
    for attn in ("sdpa", "vkv_paged"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=attn)
        pipe = pipeline("text-generation", model=model, tokenizer=tok)
        extra = {"cache_implementation": "vkv"} if attn == "vkv_paged" else {}
        torch.manual_seed(0)
        out[attn] = pipe(texts, batch_size=2, max_new_tokens=12, do_sample=True, num_return_sequences=2, **extra)
    assert out["sdpa"] == out["vkv_paged"]


def test_beam_steps_copy_at_most_one_block_per_row_and_never_remap() -> None:
    model = tiny("llama")
    inputs = prompts(2, 9, seed=3, left_pad=[0, 2])
    ref = model.generate(**inputs, max_new_tokens=16, num_beams=4, do_sample=False)
    model.set_attn_implementation("vkv_paged")
    try:
        copies: list[int] = []
        cache = VKVCache(model.config, block_tokens=4, page_bytes=SMALL_PAGE, batch_size=8, prompt_repeats=4)
        (group,) = cache.groups
        original = group.prepare

        def counting_prepare(batch: int, start: int, end: int) -> None:
            before = group.buffer.table.cow_copies if group.buffer is not None else 0
            original(batch, start, end)
            copies.append(group.buffer.table.cow_copies - before)

        group.prepare = counting_prepare  # type: ignore[method-assign]
        got = model.generate(**inputs, max_new_tokens=16, num_beams=4, do_sample=False, **{cache_kwarg(): cache})
    finally:
        model.set_attn_implementation("sdpa")
    assert_same_tokens(ref, got)
    assert max(copies) <= 8 and sum(copies) > 0  # <= one block per row per step, and beams did copy
    # the block store never moved: its memory is the high-water mark of blocks in use
    store = group.buffer.store
    assert store.num_blocks <= store.pool.stats().in_use + store.pool.stats().resident_free
    cache.check_invariants()


def test_untagged_key_values_compute_as_sdpa() -> None:
    """A DynamicCache under "vkv_paged": the attention gets plain K/V and gives sdpa's tokens."""
    model = tiny("gemma3")
    inputs = prompts(2, 9, seed=5, left_pad=[3, 0])
    ref = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    model.set_attn_implementation("vkv_paged")
    try:
        got = model.generate(**inputs, max_new_tokens=12, do_sample=False,
                             **{cache_kwarg(): DynamicCache(config=model.config)})
    finally:
        model.set_attn_implementation("sdpa")
    assert_same_tokens(ref, got)


def test_update_returns_dynamic_cache_tensors_and_tags_only_for_the_fused_kernel() -> None:
    """By default a paged layer's update returns the layer's tokens gathered through the block
    tables, untagged, as DynamicCache returns them; the fused kernel's layer returns the new states,
    tagged (a new tensor: the model's own stays untagged), and the attention call the model makes
    must read that record before the layer's next update (else that update is refused, unchanged:
    a model that replaced both after the update would have attended to the new states alone)."""
    model = tiny("llama")
    model.set_attn_implementation("vkv_paged")
    try:
        exact, fused = VKVCache(model.config, block_tokens=4), VKVCache(model.config, block_tokens=4, paged_kernel="fused")
        assert exact.layout == fused.layout == "paged"
        first, second = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 2, 16)
        exact.update(first, first.clone(), 0)
        keys, values = exact.update(second, second.clone(), 0)
        new_keys, new_values = fused.update(first, first.clone(), 0)
        vkv_paged_attention(model.model.layers[0].self_attn, torch.randn(1, 4, 3, 16), new_keys, new_values, None)
        tagged, _ = fused.update(second, second.clone(), 0)
        with pytest.raises(CacheOptionError, match="updated again with no attention call between"):
            fused.update(second, second.clone(), 0)
        assert fused.get_seq_length() == 5
    finally:
        model.set_attn_implementation("sdpa")
    assert not hasattr(keys, KV_TAG) and not hasattr(values, KV_TAG)
    assert torch.equal(keys, torch.cat([first, second], dim=2)) and torch.equal(values, keys)
    tag = getattr(tagged, KV_TAG)
    assert (tag.kv_offset, tag.kv_len, tag.fused) == (0, 5, True)
    assert not hasattr(second, KV_TAG)  # the model's own tensor stays untagged
    assert torch.equal(fused.layers[0].keys, keys)  # gathered back through the block tables


def test_a_fused_cache_read_by_another_attention_is_refused_before_it_writes() -> None:
    """The fused kernel's layer returns only the new states, which "vkv_paged" alone reads through
    their tag: a model switched to sdpa while such a cache is in use gets a typed error at its next
    forward, before anything is written, and the cache continues exactly once it is switched back."""
    model = tiny("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model.set_attn_implementation("vkv_paged")
    try:
        cache, reference = VKVCache(model.config, paged_kernel="fused"), VKVCache(model.config, paged_kernel="fused")
        with torch.no_grad():
            model(ids, **{cache_kwarg(): cache}, use_cache=True)
            model(ids, **{cache_kwarg(): reference}, use_cache=True)
            expected = model(ids[:, :1], **{cache_kwarg(): reference}, use_cache=True).logits
            model.set_attn_implementation("sdpa")
            with pytest.raises(CacheOptionError, match="read by the 'vkv_paged' attention only"):
                model(ids[:, :1], **{cache_kwarg(): cache}, use_cache=True)
            assert cache.get_seq_length() == 5
            cache.check_invariants()
            model.set_attn_implementation("vkv_paged")
            got = model(ids[:, :1], **{cache_kwarg(): cache}, use_cache=True).logits
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got, expected)


def test_the_fused_kernel_is_opt_in_and_cuda_only() -> None:
    """On an H100 the Triton kernel changed a token of a bf16 greedy run against DynamicCache at the
    first step (benchmarks/results/gpu_paged_probe.json): by default the paged attention runs sdpa
    on the gathered tokens on every device; ``paged_kernel="fused"`` is the opt-in, carried to the
    attention by the layer's tag."""
    model = tiny("llama")
    model.set_attn_implementation("vkv_paged")
    try:
        keys, _ = VKVCache(model.config).update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
        fused, _ = VKVCache(model.config, paged_kernel="fused").update(torch.randn(1, 2, 3, 16),
                                                                     torch.randn(1, 2, 3, 16), 0)
    finally:
        model.set_attn_implementation("sdpa")
    attention = model.model.layers[0].self_attn
    assert not hasattr(keys, KV_TAG)
    tag = getattr(fused, KV_TAG)
    assert tag.fused
    assert reads_in_place("cuda", tag, attention)
    assert not reads_in_place("cpu", tag, attention)
    assert not reads_in_place("cuda", tag, attention, dropout=0.1)
    assert not reads_in_place("cuda", tag, attention, output_attentions=True)
    with pytest.raises(ValueError, match="paged_kernel"):
        VKVCache(model.config, paged_kernel="triton")
    with pytest.raises(ValueError, match="paged layout only"):
        VKVCache(model.config, layout="head_major", paged_kernel="fused")

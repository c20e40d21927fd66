"""Views at DynamicCache's alignment: where a head's token of keys or values is not a multiple of
:data:`hf_vkv.devices.VIEW_ALIGNMENT_BYTES`, a head-major view starts its (row, head) blocks on
pages while DynamicCache's contiguous tensors start them ``T * D * itemsize`` bytes apart, and
torch's CPU attention rounds by where its inputs start (a tiny Llama of head dim 50 in float32 gave
decode logits 1.2e-7 apart from DynamicCache's, without an error). The layouts then hand attention
contiguous copies; the static layout, whose views cannot be copies, refuses a capacity that would
misplace its blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import BOS, EOS, PAD, VOCAB, prompts
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_vkv import CacheOptionError, PrefixStore, devices
from hf_vkv.cache.geometry import GroupGeometry
from hf_vkv.cache.sources import views_misaligned

pytestmark = pytest.mark.integration


def _llama(head_dim: int, *, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=640,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    config._attn_implementation = attn
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config = GenerationConfig(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    return model


def _same(model: Any, inputs: dict, *, cache_config: dict | None, reference: dict | None = None, seed: int = 0,
          **kwargs: Any) -> Any:
    """DynamicCache (or ``reference``'s cache), then vkv, same seed: tokens and every step's
    logits ``torch.equal``; returns vkv's output."""
    kwargs = {"max_new_tokens": 6, "return_dict_in_generate": True, "output_logits": True, **kwargs}
    torch.manual_seed(seed)
    ref = model.generate(**inputs, **(reference or {}), **kwargs)
    torch.manual_seed(seed)
    got = model.generate(**inputs, cache_implementation="vkv", cache_config=cache_config, **kwargs)
    assert torch.equal(ref.sequences, got.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}: max |diff| {(a - b).abs().max().item():.3g}"
    return got


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["greedy", "beams", "sampled"])
def test_head_major_with_a_misaligned_head_dim_is_exact(attn: str, mode: str) -> None:
    """Head dim 50 in float32 (200 bytes a head's token): the head-major layout, a padded batch.
    Before the copies, decode logits differed from DynamicCache's (1e-7) in every case here."""
    model = _llama(50, attn=attn)
    options = {"greedy": {}, "beams": {"num_beams": 2, "num_return_sequences": 2},
               "sampled": {"do_sample": True, "num_return_sequences": 2}}[mode]
    out = _same(model, prompts(3, 13, seed=3, left_pad=[0, 2, 5]), cache_config={"layout": "head_major"}, seed=5,
                **options)
    assert out.past_key_values.layout == "head_major"
    out.past_key_values.check_invariants()


def test_the_default_layout_of_a_long_prompt_with_a_misaligned_head_dim_is_exact() -> None:
    """600 tokens: the default rules give head-major; bfloat16 too (100 bytes a head's token)."""
    for dtype in (torch.float32, torch.bfloat16):
        model = _llama(50, dtype=dtype)
        out = _same(model, prompts(1, 600, seed=1), cache_config=None, max_new_tokens=4)
        assert out.past_key_values.layout == "head_major"


def test_a_prefix_store_with_a_misaligned_head_dim_continues_as_dynamic_cache() -> None:
    """A store (head-major) reused for a second turn: logits equal to a DynamicCache holding the
    first turn's tokens, continued over the second's."""
    from transformers import DynamicCache

    model = _llama(50)
    store = PrefixStore(model.config)
    first = prompts(1, 40, seed=4)
    kwargs = dict(max_new_tokens=1, do_sample=False)
    model.generate(**first, cache_implementation="vkv", cache_config={"prefix_store": store}, **kwargs)
    held = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**first, use_cache=True, **{_cache_kwarg(): held})
    second_ids = torch.cat([first["input_ids"], prompts(1, 9, seed=5)["input_ids"]], dim=1)
    second = {"input_ids": second_ids, "attention_mask": torch.ones_like(second_ids)}
    out = _same(model, second, cache_config={"prefix_store": store}, reference={_cache_kwarg(): held})
    assert store.stats().hits >= 1
    store.check_invariants()
    assert out.past_key_values is not None


def _cache_kwarg() -> str:
    from hf_vkv.generate import cache_kwarg

    return cache_kwarg()


def test_which_views_are_misaligned() -> None:
    """The rule: a head's token of keys or values not a multiple of 64 bytes, under any attention
    but vkv's own kernels."""
    def misaligned(dim: int, dtype: torch.dtype, attn: str = "sdpa", value_dim: int | None = None) -> bool:
        config = LlamaConfig()
        config._attn_implementation = attn
        geometry = GroupGeometry(2, dim, value_dim or dim, dtype, torch.device("cpu"))
        return views_misaligned(config, geometry)

    assert devices.VIEW_ALIGNMENT_BYTES == 64
    assert misaligned(50, torch.float32) and misaligned(80, torch.bfloat16) and misaligned(36, torch.float32)
    assert misaligned(64, torch.float32, value_dim=50)
    assert not misaligned(64, torch.float32) and not misaligned(96, torch.float16) and not misaligned(128, torch.bfloat16)
    assert not misaligned(50, torch.float32, attn="vkv_paged") and not misaligned(50, torch.float32, attn="vkv_cascade")


def test_the_static_layout_refuses_a_capacity_that_misplaces_its_blocks() -> None:
    """Head dim 50, float32: 37 tokens a block (7,400 bytes) refused, naming a multiple that fits
    (8); the model then generates with 40, equal to StaticCache's, and exactly as before."""
    model = _llama(50)
    inputs = prompts(1, 12, seed=2)
    with pytest.raises(CacheOptionError, match="multiple of 8"):
        model.generate(**inputs, max_new_tokens=4, cache_implementation="vkv",
                       cache_config={"layout": "static", "max_cache_len": 37})
    out = _same(model, inputs, cache_config={"layout": "static", "max_cache_len": 40},
                reference={"cache_implementation": "static", "max_cache_len": 40})
    assert out.past_key_values.layout == "static"

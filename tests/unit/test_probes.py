"""``kv_bytes`` and ``kv_bytes_per_token``: the shape formula agrees with what a DynamicCache holds."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from hf_vkv.ab.probes import kv_bytes, kv_bytes_per_token
from hf_vkv.generate import cache_kwarg


def _llama(dtype: torch.dtype) -> LlamaForCausalLM:
    # head_dim (24) is not hidden_size // heads (16): the formula must read it from the config
    cfg = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _gpt2() -> GPT2LMHeadModel:  # multi-head, no num_key_value_heads / head_dim in its config
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=64)).eval()


@pytest.mark.parametrize("build", [lambda: _llama(torch.float32), lambda: _llama(torch.bfloat16), _gpt2],
                         ids=["llama-fp32", "llama-bf16", "gpt2"])
def test_kv_bytes_per_token_matches_a_dynamic_cache(build) -> None:
    model = build()
    rows, tokens = 3, 5
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (rows, tokens)), **{cache_kwarg(): cache}, use_cache=True)
    assert kv_bytes(cache) == rows * tokens * kv_bytes_per_token(model) > 0


def test_kv_bytes_per_token_by_hand() -> None:
    # 3 layers x (K, V) x 2 KV heads x 24 dims x 2 bytes (bf16)
    assert kv_bytes_per_token(_llama(torch.bfloat16)) == 3 * 2 * 2 * 24 * 2

"""Executable spec of :class:`VKVEncoderDecoderCache.reset`: after it, both parts are empty and the
next forward may run on another number of rows (prefill once starting again on every row writes
the cross-attention cache with a batch other than the one it held)."""

from __future__ import annotations

import torch
from transformers import T5Config
from transformers.cache_utils import DynamicCache

from hf_vkv import VKVCache
from hf_vkv.cache.encoder_decoder import VKVEncoderDecoderCache

CONFIG = T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2)


def _states(rows: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, tokens, 16, generator=g), torch.randn(rows, 2, tokens, 16, generator=g)


def test_reset_lets_the_next_forward_write_another_number_of_rows() -> None:
    cache = VKVEncoderDecoderCache(VKVCache(CONFIG, layout="head_major", page_bytes=4096),
                                   DynamicCache(config=CONFIG))
    for layer in range(2):
        cache.self_attention_cache.update(*_states(1, 3, layer), layer)
        cache.cross_attention_cache.update(*_states(1, 5, 10 + layer), layer)
        cache.is_updated[layer] = True
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.cross_attention_cache.get_seq_length() == 0
    assert not any(cache.is_updated.values())
    for layer in range(2):
        keys, values = _states(2, 5, 20 + layer)
        got_keys, got_values = cache.cross_attention_cache.update(keys, values, layer)
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
        self_keys, _ = cache.self_attention_cache.update(*_states(2, 4, 30 + layer), layer)
        assert self_keys.shape == (2, 2, 4, 16)
    cache.self_attention_cache.check_invariants()

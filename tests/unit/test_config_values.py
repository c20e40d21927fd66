"""Spec of :mod:`hf_vkv.config_values`: what vkv sizes from a config (head dims, head counts) is
read layer by layer where the config differs between layers (transformers' heterogeneous configs,
``per_layer_config``), whose global value of such an attribute cannot be read at all."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_vkv.cache.cache import _layer_types, _subrows
from hf_vkv.config_values import layer_values, positive_ints
from hf_vkv.devices import subrow_item_bytes


def _heterogeneous() -> transformers.LlamaConfig:
    """Three layers: 1 / 2 / 1 key/value heads of 8 / 8 / 16 dims (hidden 32, 4 query heads)."""
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                      per_layer_config={1: {"num_key_value_heads": 2}, 2: {"head_dim": 16}})
    if not getattr(config, "per_layer_attributes", None):
        pytest.skip(f"transformers {transformers.__version__} has no per-layer configs")
    return config


def test_a_per_layer_attribute_is_read_layer_by_layer_and_others_once() -> None:
    config = _heterogeneous()
    with pytest.raises(Exception, match="per-layer attribute"):  # what reading it globally does
        _ = config.head_dim
    assert layer_values(config, "num_key_value_heads") == [1, 2, 1]
    assert layer_values(config, "head_dim") == [8, 8, 16]
    assert layer_values(config, "hidden_size") == [32]
    assert layer_values(config, "no_such_field") == [None]
    assert positive_ints(config, "head_dim", "v_head_dim") == [8, 8, 16]


def test_a_homogeneous_config_gives_its_own_value() -> None:
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert layer_values(config, "num_key_value_heads") == [2] and positive_ints(config, "head_dim") == [8]


def test_the_layout_rule_counts_every_layers_heads_and_the_widest_head() -> None:
    config = _heterogeneous()
    types, _ = _layer_types(config)
    assert _subrows(config, types) == 2 * (1 + 2 + 1)  # (layer, K/V, head) sub-rows of one row
    assert subrow_item_bytes(config, torch.float32) == 16 * 4
    assert subrow_item_bytes(config, torch.bfloat16) == 16 * 2


def test_gemma4_global_layers_are_wider() -> None:
    make = getattr(transformers, "Gemma4TextConfig", None)
    if make is None:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    config = make(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, vocab_size=128,
                  layer_types=["sliding_attention", "full_attention"])
    assert layer_values(config, "head_dim") == [16, config.per_layer_config[1].head_dim] and \
        config.per_layer_config[1].head_dim > 16
    assert subrow_item_bytes(config, torch.float32) == config.per_layer_config[1].head_dim * 4


def test_each_layer_repeats_a_shared_value() -> None:
    config = _heterogeneous()
    from hf_vkv.config_values import each_layer

    assert each_layer(config, "num_key_value_heads", 3) == [1, 2, 1]
    assert each_layer(config, "num_attention_heads", 3) == [4, 4, 4]

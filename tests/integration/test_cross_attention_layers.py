"""Decoder layers that cache another sequence: Mllama's cross-attention layers, a tiny random model.

Mllama keeps one cache for its text: its self-attention layers cache the text's tokens, and its
``cross_attention_layers`` cache the image's tokens at the prefill (34 here, against a 10-token
prompt) and are only read afterwards. In one layer group with the others, a prefill of beams or
sampled rows shared each prompt afresh for every member's token count: the cross layer's image
tokens past the text's were unmapped, and the first decode step raised ``ArgumentError: items [0,
34) of row 0 are not mapped`` after the prefill had run. They get a group of their own now
(``VKVCache.cross_attention_layers``), and a group whose members write different tokens
in one prefill is refused (``LayerMismatchError``) instead of dropping what was written.

The oracle is the same call with transformers' default cache; a text-only chat through a prefix
store is compared with a DynamicCache continued by hand over the same history.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import LlamaConfig, MllamaConfig, MllamaForConditionalGeneration  # noqa: E402

import hf_vkv  # noqa: E402  (registers "vkv")
from hf_vkv import LayerMismatchError, PrefixStore, VKVCache, reuse_report  # noqa: E402

pytestmark = pytest.mark.integration

IMAGE, PAD = 120, 0
VISION_TOKENS = 34  # (16 / 4)**2 + 1 patches of each of 2 tiles


@functools.cache
def _model(cross_layer: int) -> MllamaForConditionalGeneration:
    config = MllamaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=2, vision_output_dim=64, image_size=16, patch_size=4, max_num_tiles=2,
                           intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         cross_attention_layers=[cross_layer], pad_token_id=PAD, bos_token_id=1, eos_token_id=2),
        image_token_index=IMAGE)
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # argmax far from ties
    return model


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(3, 110, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _image_inputs(text_tokens: int) -> dict[str, Any]:
    ids = torch.tensor([[1, IMAGE] + _text(text_tokens, 11)])
    cross_mask = torch.zeros(1, ids.shape[1], 1, 2, dtype=torch.long)
    cross_mask[0, 1:, 0, :] = 1  # every token from the image on sees both tiles
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), cross_attention_mask=cross_mask,
                pixel_values=torch.randn(1, 1, 2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),
                aspect_ratio_ids=torch.tensor([[2]]), aspect_ratio_mask=torch.ones(1, 1, 2, dtype=torch.long))


def _generate(model: Any, inputs: dict[str, Any], **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return model.generate(**inputs, max_new_tokens=4, pad_token_id=PAD, return_dict_in_generate=True,
                          output_logits=True, **kwargs)


def _assert_same(got: Any, want: Any) -> None:
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))


@pytest.mark.parametrize("mode", [dict(num_beams=3), dict(do_sample=True, num_return_sequences=3)],
                         ids=["beams", "sampling"])
@pytest.mark.parametrize(("cross_layer", "text_tokens"), [(1, 8), (2, 8), (2, 60)],
                         ids=["cross-middle", "cross-last", "cross-last-long-prompt"])
def test_rows_that_share_an_image_prompt_are_as_with_dynamic_cache(mode: dict[str, Any], cross_layer: int,
                                                                  text_tokens: int) -> None:
    """Before: ``ArgumentError`` at the first decode step in the first two cases (the cross layer's
    tokens past the text's unmapped); the third ran, its prefill sharing each prompt twice."""
    model = _model(cross_layer)
    want = _generate(model, _image_inputs(text_tokens), **mode)
    got = _generate(model, _image_inputs(text_tokens), cache_implementation="vkv", **mode)
    _assert_same(got, want)
    cache = got.past_key_values if hasattr(got, "past_key_values") and got.past_key_values is not None else got.cache
    assert {group.name for group in cache.groups} == {"full_attention", "cross_attention"}
    cache.check_invariants()


def test_a_text_only_chat_reuses_its_store_and_leaves_the_image_layers_empty(tmp_path: Any) -> None:
    """Turn 2 of a text-only chat continues turn 1's prefix from the store (and from the store saved
    after turn 1 and loaded): its logits are a DynamicCache's continued over the same history.
    The store's entries hold no token of the cross-attention group (before: ``take_rows`` refused
    a group no source held tokens of)."""
    model = _model(1)
    first = torch.tensor([_text(12, 40)])
    store = PrefixStore(model.config)
    turn1 = _generate(model, dict(input_ids=first, attention_mask=torch.ones_like(first)), cache_implementation="vkv",
                      cache_config={"prefix_store": store})
    plain1 = _generate(model, dict(input_ids=first, attention_mask=torch.ones_like(first)))
    _assert_same(turn1, plain1)
    history = plain1.past_key_values if getattr(plain1, "past_key_values", None) is not None else plain1.cache
    store.save(tmp_path, model=model)  # turn 1's entries (a prefix file: the image layers' group is empty)
    loaded = PrefixStore(model.config)
    loaded.load(tmp_path, model=model)
    second = torch.cat([turn1.sequences, torch.tensor([_text(6, 31)])], 1)

    def continued() -> Any:  # transformers' idiom: turn 1's cache, continued over turn 2's new tokens
        return _generate(model, dict(input_ids=second, attention_mask=torch.ones_like(second)),
                         **{hf_vkv.generate.cache_kwarg(): copy.deepcopy(history)})

    want = continued()
    got = _generate(model, dict(input_ids=second, attention_mask=torch.ones_like(second)), cache_implementation="vkv",
                    cache_config={"prefix_store": store})
    assert reuse_report(got).reused_tokens == turn1.sequences.shape[1] - 1
    _assert_same(got, want)
    store.check_invariants()

    again = _generate(model, dict(input_ids=second, attention_mask=torch.ones_like(second)),
                      cache_implementation="vkv", cache_config={"prefix_store": loaded})
    assert reuse_report(again).reused_tokens == turn1.sequences.shape[1] - 1
    _assert_same(again, want)
    loaded.check_invariants()


def test_members_of_one_group_writing_other_token_counts_in_a_shared_prefill_are_refused() -> None:
    """By hand: two layers of one group, rows sharing their prompt, the second layer writing more
    tokens than the first. Sharing the prompt again for it dropped the first layer's tokens."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    cache = VKVCache(config, batch_size=2, prompt_repeats=2)
    states = torch.randn(2, 2, 5, 16)
    cache.update(states, states, 0)
    longer = torch.randn(2, 2, 7, 16)
    with pytest.raises(LayerMismatchError, match="must write the same tokens in a step"):
        cache.update(longer, longer, 1)
    keys, _ = cache.layers[0].keys, cache.layers[0].values
    assert torch.equal(keys[:, :, :5], states)  # what the first layer wrote is still there

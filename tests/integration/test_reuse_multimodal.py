"""Prefix reuse with a vision-language model: a tiny random Qwen2-VL, built in code, inputs built by hand.

The bug users hit: a chat that re-sent its image on turn 2 failed inside transformers with
``ValueError: Image features and image tokens do not match`` (the store's prefix, keyed by token
ids only, was started from while the image arrived at the prefill as ``pixel_values`` or
``mm_encoder_outputs``). The contract (``hf_vkv/generate/reuse.py``, ``_input_refusal``): any model
input that token ids do not identify makes reuse step aside, i.e. the call runs exactly as without
a store, the report says why, and nothing keyed by the ids alone is stored.

The oracle is the same call with a plain ``DynamicCache`` (no ``cache_implementation``, no store).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration  # noqa: E402

import hf_vkv  # noqa: E402  (registers "vkv")
from hf_vkv import PrefixStore, reuse_report  # noqa: E402

pytestmark = pytest.mark.integration

NEW = 4  # tokens generated per turn
PAD, BOS, EOS = 0, 1, 2
VOCAB = 128
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123  # the vision special ids, inside the vocabulary
TEXT_IDS = (3, 119)  # ordinary ids: [low, high)
PATCH, MERGE, TEMPORAL, CHANNELS = 4, 2, 2, 3
GRID_H, GRID_W = 4, 4  # the image in patches (multiples of MERGE)
IMAGE_TOKENS = GRID_H * GRID_W // MERGE**2
LOGIT_SCALE = 20.0  # as tests/models.py: argmax far from ties


_MODEL: Qwen2VLForConditionalGeneration | None = None


def _model() -> Qwen2VLForConditionalGeneration:
    """The tiny Qwen2-VL (built once; float32, CPU, eval; do not modify in tests)."""
    global _MODEL
    if _MODEL is None:
        config = Qwen2VLConfig(
            text_config={
                "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                # head_dim 16: the multimodal rotary sections (temporal, height, width) sum to 16 / 2
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
            },
            vision_config={
                "depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                "in_channels": CHANNELS, "patch_size": PATCH, "spatial_merge_size": MERGE,
                "temporal_patch_size": TEMPORAL,
            },
            image_token_id=IMAGE, video_token_id=VIDEO,
            vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        )
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(LOGIT_SCALE)
        _MODEL = model
    return _MODEL


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(*TEXT_IDS, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _image(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values [patches, C*T*P*P], image_grid_thw [[1, h, w]])``, as the processor would give."""
    pixels = torch.randn(GRID_H * GRID_W, CHANNELS * TEMPORAL * PATCH * PATCH,
                         generator=torch.Generator().manual_seed(seed))
    return pixels, torch.tensor([[1, GRID_H, GRID_W]])


def _image_prompt() -> list[int]:
    return _text(5, 10) + [VISION_START] + [IMAGE] * IMAGE_TOKENS + [VISION_END] + _text(4, 11)


def _image_inputs(ids: torch.Tensor, how: str) -> dict[str, Any]:
    """The image's model inputs for ``ids``, fresh for each call (generate fills dicts in place).

    ``pixels``: ``pixel_values`` + ``image_grid_thw`` (generate encodes them into ``mm_encoder_outputs``);
    ``processor``: the same plus ``mm_token_type_ids`` as Qwen2-VL's processor returns (3-D rotary positions);
    ``encoded``: the image encoded beforehand, passed as ``mm_encoder_outputs``.
    """
    if how == "encoded" and "mm_encoder_outputs" not in inspect.signature(_model().forward).parameters:
        pytest.skip("this transformers takes no pre-encoded images (mm_encoder_outputs came with 5.24)")
    pixels, grid = _image()
    inputs: dict[str, Any] = {"image_grid_thw": grid}
    if how == "encoded":
        with torch.no_grad():
            inputs["mm_encoder_outputs"] = {
                "image": _model().model.get_image_features(pixels, grid, return_dict=True)}
    else:
        inputs["pixel_values"] = pixels
    if how == "processor":
        inputs["mm_token_type_ids"] = (ids == IMAGE).int()
    return inputs


def _generate(ids: torch.Tensor, store: PrefixStore | None, **inputs: Any) -> Any:
    """A greedy call; with ``store``: VKV with prefix reuse, without: transformers' DynamicCache."""
    extra = {"cache_implementation": "vkv", "cache_config": {"prefix_store": store}} if store is not None else {}
    return _model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=PAD, return_dict_in_generate=True, **inputs, **extra)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), f"tokens differ from DynamicCache's:\n vkv: {got.tolist()}\n ref: {want.tolist()}"


@pytest.mark.parametrize("how", ["pixels", "processor", "encoded"])
def test_turn_two_resends_the_image(how: str) -> None:
    """Turn 2 re-sends turn 1's image: no raw transformers error, DynamicCache's tokens, reuse steps
    aside naming the image input, and the store holds nothing keyed by the ids alone."""
    store = PrefixStore(_model().config)
    ids = torch.tensor([_image_prompt()])
    for turn in (1, 2):
        out = _generate(ids, store, **_image_inputs(ids, how))
        ref = _generate(ids, None, **_image_inputs(ids, how))
        _assert_same(out.sequences, ref.sequences)
        report = reuse_report(out)
        assert report is not None, f"turn {turn}: no reuse report"
        assert report.refusal is not None and "not identified by token ids" in report.refusal, \
            f"turn {turn}: {report}"
        assert any(name in report.refusal for name in ("pixel_values", "mm_encoder_outputs", "mm_token_type_ids",
                                                       "image_grid_thw")), report.refusal
        assert report.reused_tokens == 0, report
        # an image's K/V keyed by token ids only would serve the next call with another image
        assert len(store) == 0, f"turn {turn}: a stepped-aside call stored {len(store)} entries"
        store.check_invariants()
        ids = torch.cat([out.sequences, torch.tensor([_text(3, 20 + turn)])], dim=1)  # answer + new text


def test_text_only_turns_of_the_vlm() -> None:
    """Two text-only turns of the same model: DynamicCache's tokens on both; reuse on turn 2 if it applies.

    With transformers 5.x it does not apply: for every call of a model that takes images, generate
    sets ``mm_encoder_outputs={}`` (``_prepare_multimodal_encoder_kwargs_for_generation``), which
    reuse reads as an image input and steps aside for; and Qwen2-VL passes its positions as 4-D
    ``position_ids`` ``[text + 3 rotary sections, rows, tokens]``, which the positions check
    refuses too. Stepping aside is a legitimate outcome (never a wrong token, never a raw error):
    the test asserts it gives a reason, and asserts real reuse should a later version apply it.
    """
    store = PrefixStore(_model().config)
    ids = torch.tensor([_text(8, 30)])
    for turn in (1, 2):
        out = _generate(ids, store)
        ref = _generate(ids, None)
        _assert_same(out.sequences, ref.sequences)
        report = reuse_report(out)
        assert report is not None, f"turn {turn}: no reuse report"
        if report.refusal is None:  # reuse applies: turn 2 starts from turn 1's stored prompt and answer
            if turn == 2:
                assert report.reused_tokens > 0, report
        else:  # reuse steps aside, with a reason, and runs exactly as without a store
            assert isinstance(report.refusal, str) and report.refusal, report
            # not "not identified by token ids": no image was given (the reason misled users); 5.17 passes no
            # mm_encoder_outputs, and Qwen2-VL's 4-D positions are refused
            assert "not identified" not in report.refusal, report
            assert report.reused_tokens == 0, report
        store.check_invariants()
        ids = torch.cat([out.sequences, torch.tensor([_text(3, 40 + turn)])], dim=1)

"""Prefill once at the user's thread counts: the cases where a forward on one row per prompt used to
round differently from DynamicCache's expanded forward (small matmuls split along the reduction at
>= 2 threads, heads with a transform before the decoder, multimodal rotary position ids) are
``torch.equal`` to DynamicCache at 1, 2 and 8 intra-op threads, and every fallback is counted in
``stats()``."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GenerationConfig

import hf_vkv.generate.row_exactness as row_exactness
from models import BOS, EOS, PAD, VOCAB, prompts

pytestmark = pytest.mark.integration

SMALL = {"page_bytes": 4096}


def _build(model_cls: str, config_cls: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    config = getattr(transformers, config_cls)(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.generation_config = GenerationConfig(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
                                               decoder_start_token_id=kwargs.get("decoder_start_token_id"))
    return model


def _llama(hidden: int = 64) -> torch.nn.Module:
    return _build("LlamaForCausalLM", "LlamaConfig", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def ab(model, inputs: dict, *, seed: int = 0, **kwargs):
    """DynamicCache, then vkv (small pages), same seed: both outputs; asserts tokens, scores and
    logits are ``torch.equal`` and returns vkv's stats."""
    kwargs = dict(max_new_tokens=4, return_dict_in_generate=True, output_logits=True, output_scores=True, **kwargs)
    torch.manual_seed(seed)
    ref = model.generate(**inputs, **kwargs)
    torch.manual_seed(seed)
    got = model.generate(**inputs, cache_implementation="vkv", cache_config=SMALL, **kwargs)
    assert torch.equal(ref.sequences, got.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}: max |diff| {(a - b).abs().max().item():.3g}"
    for a, b in zip(ref.scores, got.scores, strict=True):
        assert torch.equal(a, b)
    if hasattr(ref, "sequences_scores"):
        assert torch.equal(ref.sequences_scores, got.sequences_scores)
    cache = got.past_key_values
    inner = getattr(cache, "self_attention_cache", cache)
    inner.check_invariants()
    return inner.stats()


#: What ``stats().prefill_once`` says when DynamicCache's own forward computes a prompt's repeats
#: differently from each other (then no forward on one row per prompt can give its bits).
PROVEN_NECESSARY = "computes a prompt's repeats differently from each other"


def _on(stats, *, or_proven: bool = False) -> None:
    """Prefill once served the prompt (or, with ``or_proven``, stepped aside for the one reason
    that makes it impossible on this machine, counted in ``stats()``)."""
    if or_proven and PROVEN_NECESSARY in stats.prefill_once:
        assert stats.prompt_tokens_saved == 0
        return
    assert stats.prefill_once.startswith("on"), stats.prefill_once
    assert stats.prompt_tokens_saved > 0


@pytest.mark.threads(1, 2, 8)
@pytest.mark.parametrize("shape", [(1, 5), (2, 3), (1, 6), (1, 7), (3, 3), (1, 9)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_short_prompts_sampled(shape: tuple[int, int]) -> None:
    _on(ab(_llama(), prompts(*shape, seed=1), do_sample=True, num_return_sequences=3))


@pytest.mark.threads(1, 2, 8)
@pytest.mark.parametrize("mode", ["n8", "beams8"])
def test_hidden_768(mode: str) -> None:
    kwargs = dict(do_sample=True, num_return_sequences=8) if mode == "n8" else dict(do_sample=False, num_beams=8)
    # or proven: on a 2-core AMD EPYC (AVX2) at 2 and 8 threads DynamicCache's own 8 repeats of the
    # prompt differ in the linear layers, so no one row can give all of them
    _on(ab(_llama(768), prompts(1, 5, seed=1), **kwargs), or_proven=True)


@pytest.mark.threads(1, 2, 8)
@pytest.mark.parametrize("chunk", [4, 5])
def test_chunked_prefill(chunk: int) -> None:
    _on(ab(_llama(), prompts(2, 11, seed=2, left_pad=[0, 2]), do_sample=True, num_return_sequences=3,
           prefill_chunk_size=chunk), or_proven=True)  # chunk 5: a last chunk of 1 token x 2 prompts


_T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
           decoder_start_token_id=PAD, relative_attention_num_buckets=8)
_BART = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
             decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
             decoder_start_token_id=BOS, forced_eos_token_id=None)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=64, is_decoder=True)
_DECODER_ONLY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=64, head_dim=16)
#: Heads with something between the base model and the output embeddings (a transform, a norm,
#: soft-capping, a scale, a bias), and the plain ones.
HEADS = {
    "bert": ("BertLMHeadModel", "BertConfig", _ENCODER),
    "roberta": ("RobertaForCausalLM", "RobertaConfig", _ENCODER),
    "camembert": ("CamembertForCausalLM", "CamembertConfig", _ENCODER),
    "xlm_roberta": ("XLMRobertaForCausalLM", "XLMRobertaConfig", _ENCODER),
    "electra": ("ElectraForCausalLM", "ElectraConfig", {**_ENCODER, "embedding_size": 16}),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=2, max_position_embeddings=64)),  # head reads the decoder
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER_ONLY),
    "gemma2_softcap": ("Gemma2ForCausalLM", "Gemma2Config", {**_DECODER_ONLY, "final_logit_softcapping": 0.5,
                                                             "query_pre_attn_scalar": 16, "sliding_window": 64}),
    "t5_tied": ("T5ForConditionalGeneration", "T5Config", {**_T5, "tie_word_embeddings": True}),
    "bart": ("BartForConditionalGeneration", "BartConfig", _BART),
}


@pytest.mark.threads(1, 2, 8)
@pytest.mark.parametrize("arch", list(HEADS))
def test_every_head_runs_on_every_row(arch: str) -> None:
    model_cls, config_cls, kwargs = HEADS[arch]
    model = _build(model_cls, config_cls, **kwargs)
    # an encoder-decoder's prefill is its decoder's start token: one token row per prompt
    _on(ab(model, prompts(2, 6, seed=3, left_pad=[0, 2]), do_sample=True, num_return_sequences=3),
        or_proven=model.config.is_encoder_decoder)


@pytest.mark.threads(1, 2, 8)
@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_encoder_decoder_five_prompts(arch: str) -> None:
    model = _build(*HEADS["t5_tied" if arch == "t5" else "bart"][:2], **(_T5 if arch == "t5" else _BART))
    _on(ab(model, prompts(5, 7, seed=4), do_sample=True, num_return_sequences=3), or_proven=True)


def _qwen2_vl():
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    return _build("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", text_config=text, vision_config=vision,
                  image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
                  vision_end_token_id=VOCAB - 4, **{k: text[k] for k in ("vocab_size",)})


@pytest.mark.threads(1, 2, 8)
def test_vision_language_model_text_and_image() -> None:
    model = _qwen2_vl()
    _on(ab(model, prompts(2, 6, seed=5, left_pad=[0, 1]), do_sample=True, num_return_sequences=3))
    # an image: its patches are not indexed by row (image grids place them), so every row is prefilled
    ids = torch.tensor([[5, 6, VOCAB - 3] + [VOCAB - 1] * 4 + [VOCAB - 4, 7]])
    image = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "pixel_values": torch.randn(16, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(0)),
             "image_grid_thw": torch.tensor([[1, 4, 4]])}
    stats = ab(model, image, do_sample=True, num_return_sequences=3)
    assert stats.prefill_once.startswith("prefill once cannot place the rows of "), stats.prefill_once
    assert stats.prompt_tokens_saved == 0


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("forced", ["expanded", "inexact"])
def test_a_call_that_differs_runs_on_every_row(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    """Whatever the kernels do: a call whose one-row-per-prompt result differs runs on the expanded
    rows (``expanded``), and a call whose repeats differ among themselves sends the whole prefill to
    every row (``inexact``, after the rows written so far are dropped)."""
    row_exactness.clear_verdicts()
    monkeypatch.setattr(row_exactness.RowExactness, "_prove",
                        lambda self, func, args, kwargs: f"repeats:{self.repeats}")  # every row
    monkeypatch.setattr(row_exactness.RowExactness, "_same_lanes", lambda self, operands: False)
    if forced == "inexact":  # DynamicCache's own repeats of a prompt differ
        monkeypatch.setattr(row_exactness, "_bits_equal", lambda a, b: False)
    try:
        stats = ab(_llama(), prompts(2, 7, seed=6), do_sample=True, num_return_sequences=3)
    finally:
        row_exactness.clear_verdicts()
    if forced == "expanded":
        assert stats.prefill_once.startswith("on; ") and "call(s) ran on every row" in stats.prefill_once
        assert stats.prompt_tokens_saved == 2 * 2 * 7
    else:
        assert "computes a prompt's repeats differently" in stats.prefill_once
        assert (stats.prompt_tokens_computed, stats.prompt_tokens_saved) == (6 * 7, 0)

"""Exact by construction: prefill once admits an operation by a rule on what its kernel branches on
(shapes, strides, dtype, threads, vector width), never by the values it happened to see.

The cases where a verdict drawn from one sample of values used to let a result through that
DynamicCache does not compute (an fp32 ``silu`` on 400 elements, T5's and BART's attention at 2
threads, a bfloat16 call after earlier ones in the same process), random scans over five models,
and a property test per operation kind: every result ``torch.equal`` to DynamicCache's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from models import EOS, PAD, VOCAB, prompts, tokenizer
from test_prefill_exact import _BART, _T5, _build, _llama, ab

import hf_vkv.generate.row_exactness as rx

pytestmark = pytest.mark.integration


def _expect_on_or_proven(stats: Any) -> None:
    """Prefill once served the prompt, or stepped aside because DynamicCache's own repeats differ
    (then nothing on one row per prompt can give its bits); ``ab`` compared every bit either way."""
    said = stats.prefill_once
    assert said.startswith("on") or "repeats differently from each other" in said, said


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("seed", range(6))
def test_hidden_200_one_token_prompt_four_samples(seed: int) -> None:
    """Hidden 200 (intermediate 400: ``silu`` rows of 400 elements, not a multiple of the vector
    loop's block): a 1-token prompt, ``num_return_sequences=4``."""
    _expect_on_or_proven(ab(_llama(200), prompts(1, 1, seed=seed), seed=seed, do_sample=True,
                            num_return_sequences=4))


@pytest.mark.threads(2)
@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_encoder_decoders_sampled_at_two_threads(arch: str) -> None:
    model = _build(*(("T5ForConditionalGeneration", "T5Config") if arch == "t5"
                     else ("BartForConditionalGeneration", "BartConfig")), **(_T5 if arch == "t5" else _BART))
    for seed in (11, 12, 13):
        _expect_on_or_proven(ab(model, prompts(2, 6, seed=seed), seed=seed, do_sample=True, num_return_sequences=3))


@pytest.mark.threads(2)
@pytest.mark.parametrize("arch", ["marian", "bart"])
def test_an_unpadded_source_s_first_cross_attention_at_two_threads(arch: str) -> None:
    """The first decoder step's cross-attention over an unpadded source is SDPA with one query, no
    mask and not causal: at 2 threads its result on one row per prompt depended on the values, so
    it runs on every row. The Marian case is the one found (on a 2-core Intel Xeon its first logits
    were 2.4e-7 from DynamicCache's with 4 beams, its proofs' three draws agreeing), then unpadded
    single prompts, beams, beam sampling and samples."""
    if arch == "marian":
        model = _build("MarianMTModel", "MarianConfig", vocab_size=128, decoder_vocab_size=128, d_model=32,
                       encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                       encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, decoder_start_token_id=PAD)
        with torch.no_grad():  # sharper logits, as trained weights give: more of them tell rows apart
            model.get_output_embeddings().weight.mul_(10.0)
            model.get_output_embeddings().weight[EOS].mul_(0.01)
        ids = torch.tensor([[59, 19, 16, 71, 10, 46, 114, 116, 41, 90, 56, 60, 102, 88, 10, 11, 79, 109, 93, 117, 101,
                             125, 89]])
        found = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        ab(model, found, seed=380, num_beams=4)
        ab(model, found, seed=380, do_sample=True, num_beams=4)
        ab(model, found, seed=380, do_sample=True, num_return_sequences=4)
        vocab = 128
    else:
        model = _build("BartForConditionalGeneration", "BartConfig", **_BART)
        vocab = VOCAB
    for seed in range(3):
        inputs = prompts(1, 15 + 4 * seed, seed=seed)
        inputs["input_ids"] = inputs["input_ids"] % vocab
        ab(model, inputs, seed=seed, num_beams=4)
        ab(model, inputs, seed=seed, do_sample=True, num_beams=4)
        ab(model, inputs, seed=seed, do_sample=True, num_return_sequences=4)


def _bf16_llama() -> torch.nn.Module:
    return _llama(64).to(torch.bfloat16)


@pytest.mark.threads(1, 2)
def test_a_bfloat16_call_after_45_others_is_as_in_a_fresh_process() -> None:
    """45 calls of other shapes first (the verdicts they leave behind), then 4 beams: every call
    bit-equal to DynamicCache (nothing a call leaves behind changes a later one's result)."""
    model = _bf16_llama()
    for i in range(45):
        ab(model, prompts(1 + i % 3, 2 + i % 9, seed=100 + i), seed=i, do_sample=True, num_return_sequences=2 + i % 3)
    _expect_on_or_proven(ab(model, prompts(2, 5, seed=7), do_sample=False, num_beams=4))


def _scan_model(name: str) -> torch.nn.Module:
    if name == "t5":
        return _build("T5ForConditionalGeneration", "T5Config", **_T5)
    if name == "bart":
        return _build("BartForConditionalGeneration", "BartConfig", **_BART)
    if name == "gpt2":
        return _build("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                      n_inner=96)
    if name == "llama_bf16":
        return _bf16_llama()
    return _llama(64)


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("name", ["t5", "bart", "llama_fp32", "llama_bf16", "gpt2"])
def test_random_scan(name: str) -> None:
    """60 random calls (batch, prompt length, left padding, sampling or beams): zero differences."""
    model = _scan_model(name)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    for call in range(60):
        batch = int(torch.randint(1, 4, (1,), generator=g))
        length = int(torch.randint(1, 13, (1,), generator=g))
        pads = [int(torch.randint(0, length, (1,), generator=g)) if r and length > 1 else 0 for r in range(batch)]
        k = int(torch.randint(2, 5, (1,), generator=g))
        mode = dict(do_sample=True, num_return_sequences=k) if call % 3 else dict(do_sample=False, num_beams=k)
        _expect_on_or_proven(ab(model, prompts(batch, length, seed=call, left_pad=pads), seed=call,
                                **mode))


#: Operation kinds prefill once watches, as models call them: ``(name, call)``.
F = torch.nn.functional
_OPS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("silu", F.silu), ("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
    ("tanh", torch.tanh), ("sigmoid", torch.sigmoid), ("exp", torch.exp), ("rsqrt", lambda t: torch.rsqrt(t.abs() + 1e-6)),
    ("pow", lambda t: t.pow(2)), ("softmax", lambda t: t.softmax(-1)),
    ("layer_norm", lambda t: F.layer_norm(t, t.shape[-1:])),
    ("rms_norm", lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)),
]


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("length", [1, 7, 200, 400, 1000, 64, 576])
@pytest.mark.parametrize("name", [n for n, _ in _OPS])
def test_property_every_operation_kind(name: str, length: int) -> None:
    """1000 random inputs per operation kind and row length (odd ones among them), 2 prompts of 3
    rows, 4 repeats: the result through prefill once's rule equals DynamicCache's rows bit for bit,
    or the call is refused (every row prefilled) because DynamicCache's own repeats differ; an
    elementwise call runs on DynamicCache's rows exactly when the lane rule does not admit it."""
    op = dict(_OPS)[name]
    prompts_, rows, k = 2, 3, 4
    g = torch.Generator().manual_seed(length)
    mode = rx.RowExactness(prompts=prompts_, repeats=k)
    mode.watching = True
    for draw in range(1000):
        scale = 10 ** float(torch.empty(1).uniform_(-3, 2, generator=g))
        x = torch.randn(prompts_ * rows, length, generator=g) * scale
        tall = op(rx.expand_operand(x, prompts_, k)).reshape(prompts_, k, rows, length)  # DynamicCache's rows
        try:
            with mode:
                got = op(x)
        except rx.InexactRows:  # refused: DynamicCache's own repeats of a prompt differ, so every row is prefilled
            assert not torch.equal(tall, tall[:, :1].expand_as(tall)), (name, length, draw)
            continue
        assert torch.equal(got, tall[:, 0].reshape(-1, length)), (name, length, draw)
    if name in ("silu", "gelu", "tanh", "sigmoid", "exp"):
        admitted = rx.same_lanes(prompts_ * rows * length, 4, prompts=prompts_, repeats=k,
                                 threads=torch.get_num_threads())
        if length in (64, 576):  # rows as real models have them (multiples of 64): always admitted
            assert admitted
        assert (mode.expanded == 0) == admitted, (mode.expanded, admitted)


def test_same_lanes_is_the_loop_structure() -> None:
    """The rule, against the loop it models: with 2 threads, a tensor of 2 x 32768 float32 splits
    into two chunks of 32768, so rows of 16 x 2048 (multiples of every block) are admitted, and
    a row of 400 elements is admitted by no vector width (its tail moves with the row count)."""
    assert rx.same_lanes(2 * 64, 4, prompts=2, repeats=4, threads=1)
    assert rx.same_lanes(2 * 2048 * 16, 4, prompts=2, repeats=8, threads=2)
    assert not rx.same_lanes(400, 4, prompts=1, repeats=4, threads=1)
    assert not rx.same_lanes(7, 2, prompts=1, repeats=3, threads=1)
    assert rx.same_lanes(64, 2, prompts=1, repeats=3, threads=1)  # bfloat16: 64 elements, 128 bytes


def test_proofs_do_not_read_the_values() -> None:
    """A matmul's proof is made on synthetic operands: its verdict is the same whatever values the
    call had, and kept for the call's signature only."""
    rx.clear_verdicts()
    weight = torch.nn.Parameter(torch.randn(96, 200), requires_grad=False)
    verdicts = []
    for values in (torch.zeros(5, 200), torch.randn(5, 200), torch.full((5, 200), math.pi)):
        mode = rx.RowExactness(prompts=1, repeats=4)
        mode.watching = True
        with mode:
            F.linear(values, weight)
        verdicts.append(dict(rx._VERDICTS))
    assert len(verdicts[0]) == 1 and verdicts[0] == verdicts[1] == verdicts[2]
    rx.clear_verdicts()


def test_cli_ab_on_the_hidden_200_model_prints_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The product's own A/B on the model the rule was written for: prompt "Hi", 4 samples."""
    from hf_vkv import cli

    model = _llama(200)
    model.save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    for threads in ("1", "2"):
        try:
            code = cli.main(["ab", "--model", str(tmp_path), "--prompt", "Hi", "--raw", "--mode", "sample",
                             "--num-return-sequences", "4", "--max-new-tokens", "4", "--threads", threads, "--quiet"])
        except SystemExit as e:
            code = int(e.code)
        out = capsys.readouterr().out
        assert code == 0 and "IDENTICAL" in out and "DIVERGED" not in out, out

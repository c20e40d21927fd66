"""Prefill once, unit specs: which rows repeat, where each input's rows are, cutting inputs to one
row per prompt and expanding outputs back, and the row-exactness probe its exactness rests on
(``hf_vkv.generate.row_exactness``), at user thread counts (1, 2, and oversubscribed 8 and 16)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_vkv.generate.row_exactness as rx
from hf_vkv.generate.prefill_once import expand_rows, first_of_repeats, repeats_refusal


def _repeated(prompts: int, k: int, tokens: int = 5) -> torch.Tensor:
    return torch.arange(prompts * tokens).reshape(prompts, tokens).repeat_interleave(k, dim=0)


def test_repeats_refusal_names_the_input_that_differs() -> None:
    ids = _repeated(2, 3)
    mask = torch.ones_like(ids)
    assert repeats_refusal(ids, {"attention_mask": mask, "cache_position": torch.arange(6)}, 3) is None
    mask[4, 0] = 0  # prompt 1, its second repeat
    assert repeats_refusal(ids, {"attention_mask": mask}, 3) == "the rows of 'attention_mask' differ within a repeated prompt"
    assert repeats_refusal(ids, {}, 4) == "6 rows are not a multiple of 4"
    other = ids.clone()
    other[1, 2] += 1
    assert repeats_refusal(other, {}, 3) == "the rows of 'input_ids' differ within a repeated prompt"
    # tensors nested in a ModelOutput (encoder outputs) are checked too
    enc = CausalLMOutputWithPast(logits=torch.randn(6, 2))
    assert repeats_refusal(ids, {"encoder_outputs": enc}, 3) == "the rows of 'encoder_outputs' differ within a repeated prompt"


def test_first_of_repeats_and_expand_rows_are_inverse() -> None:
    cache = object()
    kwargs = {"attention_mask": _repeated(2, 3), "cache": cache, "use_cache": True, "logits_to_keep": 1,
              "encoder_outputs": CausalLMOutputWithPast(logits=_repeated(2, 3).float(), hidden_states=None)}
    unique = first_of_repeats(kwargs, 6, 3, keep=cache)
    assert unique is not kwargs and unique["cache"] is cache and unique["use_cache"] is True
    assert torch.equal(unique["attention_mask"], _repeated(2, 1))
    assert isinstance(unique["encoder_outputs"], CausalLMOutputWithPast)
    assert torch.equal(unique["encoder_outputs"].logits, _repeated(2, 1).float())
    assert kwargs["attention_mask"].shape[0] == 6  # the caller's inputs are untouched
    out = CausalLMOutputWithPast(logits=torch.randn(6, 1, 4), past_key_values=cache,
                                 hidden_states=(torch.randn(2, 5, 3), torch.randn(2, 5, 3)))
    full = expand_rows(out, 2, 3, keep=cache)
    assert isinstance(full, CausalLMOutputWithPast) and full.past_key_values is cache
    assert full.logits is out.logits  # already one row per expanded row
    assert [h.shape[0] for h in full.hidden_states] == [6, 6]
    assert torch.equal(full.hidden_states[0][3], out.hidden_states[0][1])
    assert full["hidden_states"] is full.hidden_states


def test_rows_of_every_layout_are_placed_or_refused() -> None:
    ids = _repeated(2, 3)
    mrope = ids[None].expand(3, 6, 5).clone()  # multimodal rotary position ids [3, B, T]
    kwargs = {"position_ids": mrope, "token_type_ids": torch.zeros_like(ids), "cache_position": torch.arange(5)}
    assert repeats_refusal(ids, kwargs, 3) is None
    unique = first_of_repeats(kwargs, 6, 3)
    assert unique["position_ids"].shape == (3, 2, 5) and torch.equal(unique["position_ids"], mrope[:, ::3])
    assert unique["position_ids"].is_contiguous() and unique["cache_position"] is kwargs["cache_position"]
    mrope[1, 4, 0] += 1  # prompt 1's second repeat, in the second rotary section
    assert repeats_refusal(ids, kwargs, 3) == "the rows of 'position_ids' differ within a repeated prompt"
    # inputs whose rows this module cannot place: prefill once steps aside, naming them
    pixels = {"pixel_values": torch.zeros(16, 24), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    assert repeats_refusal(ids, pixels, 3) == "prefill once cannot place the rows of 'pixel_values' (shape [16, 24])"
    assert repeats_refusal(ids, {"attention_mask": torch.ones(5, 5)}, 3).startswith("'attention_mask' of shape [5, 5]")


def _linear_through_probe(x: torch.Tensor, weight: torch.Tensor, prompts: int, k: int) -> tuple[torch.Tensor, int]:
    mode = rx.RowExactness(prompts=prompts, repeats=k)
    mode.watching = True
    with mode:
        y = torch.nn.functional.linear(x, weight)
    return y, mode.expanded


@pytest.mark.parametrize("threads", [1, 2, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_gives_dynamic_cache_bits_at_any_thread_count(threads: int, dtype: torch.dtype) -> None:
    """Whatever rows a matmul rounds differently at this thread count (with 2 threads, fp32 on 5-11
    rows; oversubscribed, 17-19 and 25-27 too), the probed call returns exactly the rows the
    expanded matmul computes: DynamicCache's."""
    torch.set_num_threads(threads)
    rx.clear_verdicts()
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(1536, 576, generator=g).to(dtype), requires_grad=False)  # not a row input
    expanded = 0
    for prompts, tokens in [(1, 1), (1, 3), (1, 5), (1, 7), (2, 3), (1, 9), (1, 11), (3, 6), (1, 19), (1, 26), (2, 64)]:
        x = torch.randn(prompts * tokens, 576, generator=g).to(dtype)
        for k in (3, 8):
            big = torch.nn.functional.linear(rx.expand_operand(x, prompts, k), weight)  # DynamicCache's rows
            grouped = big.reshape(prompts, k, tokens, -1)
            if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
                with pytest.raises(rx.InexactRows):  # its own repeats differ: only every row is exact
                    _linear_through_probe(x, weight, prompts, k)
                continue
            y, n = _linear_through_probe(x, weight, prompts, k)
            expanded += n
            assert torch.equal(y.reshape(prompts, 1, tokens, -1).expand_as(grouped), grouped), (prompts, tokens, k)
            y_again, _ = _linear_through_probe(x, weight, prompts, k)  # the cached verdict
            assert torch.equal(y_again, y)
    rx.clear_verdicts()


def test_verdicts_are_keyed_by_thread_count() -> None:
    rx.clear_verdicts()
    x, weight = torch.randn(5, 64), torch.nn.Parameter(torch.randn(128, 64), requires_grad=False)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        _linear_through_probe(x, weight, 1, 4)
    keys = [key for key in rx._VERDICTS if key[0] is torch.nn.functional.linear]
    assert sorted(key[5] for key in keys) == [1, 2]  # (func, args, kwargs, prompts, repeats, threads, ...)
    rx.clear_verdicts()


def test_expand_operand_keeps_the_layout() -> None:
    fused = torch.randn(2, 5, 3 * 8)[..., 8:16]  # a view into a fused projection: row stride 24
    big = rx.expand_operand(fused, 2, 3)
    assert big.shape == (6, 5, 8) and big.stride() == fused.stride()
    assert big.storage_offset() == fused.storage_offset()
    assert torch.equal(big, fused.repeat_interleave(3, dim=0))
    flat = torch.randn(2 * 5, 4)  # [B*T, K] rows: each prompt's 5 rows repeated as a block
    assert torch.equal(rx.expand_operand(flat, 2, 3), flat.reshape(2, 5, 4).repeat_interleave(3, 0).reshape(30, 4))
    broadcast = torch.randn(1, 4, 1).expand(2, 4, 1)
    assert rx.expand_operand(broadcast, 2, 3).stride(0) == 0
    # one row's keys viewed for four query heads (repeat_kv): dim 0 of stride 0 is one row, not a broadcast;
    # DynamicCache's rows of the same view follow one another
    one = torch.randn(1, 1, 7, 16)[:, :, None].expand(1, 1, 4, 7, 16).reshape(1, 4, 7, 16).transpose(2, 3)
    assert one.stride() == (0, 0, 1, 16)
    tall = torch.randn(3, 1, 7, 16)[:, :, None].expand(3, 1, 4, 7, 16).reshape(3, 4, 7, 16).transpose(2, 3)
    big = rx.expand_operand(one, 1, 3)
    assert big.stride() == tall.stride() == (112, 0, 1, 16)
    assert torch.equal(big, one.expand(3, -1, -1, -1))
    # sequence-first states ([T, B, C], FSMT's cross-attention keys: a transposed view of [B, T, C]) taken for rows:
    # at k x dim 0 their strides alias, which the expansion once wrote over itself; no call can be DynamicCache's
    states = torch.randn(2, 8, 32).transpose(0, 1)
    with pytest.raises(rx.InexactRows, match="not its outermost dim"):
        rx.expand_operand(states, 2, 2)
    assert not rx._overlaps((6, 5, 8), fused.stride()) and rx._overlaps((16, 2, 32), states.stride())


@pytest.mark.parametrize("threads", [1, 2, 8, 16])
def test_norms_softmax_and_activations_are_probed(threads: int) -> None:
    """Reductions and transcendental elementwise functions are watched too: their results equal
    the expanded call's first repeat."""
    torch.set_num_threads(threads)
    rx.clear_verdicts()
    x = torch.randn(5, 1, 64)
    mode = rx.RowExactness(prompts=5, repeats=3)
    mode.watching = True
    calls = [lambda t: torch.nn.functional.gelu(t), lambda t: t.pow(2).mean(-1, keepdim=True),
             lambda t: torch.nn.functional.layer_norm(t, (64,)), lambda t: t.softmax(-1), lambda t: torch.tanh(t)]
    for call in calls:
        ref = call(x.repeat_interleave(3, 0)).reshape(5, 3, 1, -1)[:, 0]
        with mode:
            got = call(x)
        assert torch.equal(got, ref)
    assert mode.counts.probed == 3  # mean, layer_norm, softmax are proved; gelu, pow, tanh take the lane rule
    rx.clear_verdicts()


def _shape_bumped(below: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A stand-in for a kernel whose rounding depends on the rows it is given: a row's result
    gains 0.5 when the call has fewer than ``below`` rows (as a BLAS that splits a short
    product's reduction between threads rounds it otherwise)."""
    def bumped(x: torch.Tensor) -> torch.Tensor:
        if torch.overrides.has_torch_function((x,)):  # dispatched through the active mode, as torch's own functions
            return torch.overrides.handle_torch_function(bumped, (x,), x)
        return x.sum(-1, keepdim=True) + (0.5 if x.shape[0] < below else 0.0)
    return bumped


@pytest.mark.parametrize(("below", "k", "verdict", "partial", "expanded"), [
    (2, 8, "repeats:2", 1, 0),   # two repeats compute what eight do
    (5, 16, "repeats:8", 1, 0),  # the ladder's smallest m (2, 4, 8) whose rows match
    (8, 8, "repeats:8", 0, 1),   # only all eight: DynamicCache's rows
    (3, 3, "repeats:3", 0, 1),   # k = 3: no ladder (2m <= k has no m), straight to every row
    (1, 8, "exact", 0, 0),       # one row per prompt computes it
])
def test_a_call_runs_on_the_fewest_repeats_proved_to_give_dynamic_cache_bits(
        monkeypatch: pytest.MonkeyPatch, below: int, k: int, verdict: str, partial: int, expanded: int) -> None:
    """Prefill once's ladder: a proved call not admitted on one row per prompt runs on the fewest
    repeats ``m`` (a power of two, ``2m <= k``) whose first repeat equals every one of the ``k``
    rows on the proof's draws, else on all ``k``; either way the rows handed back are DynamicCache's."""
    func = _shape_bumped(below)
    monkeypatch.setattr(rx, "_PROVED_FUNCTIONS", rx.proved_functions() | {func})
    rx.clear_verdicts()
    try:
        x = torch.randn(1, 6, generator=torch.Generator().manual_seed(below))  # 1 prompt of 1 row
        mode = rx.RowExactness(prompts=1, repeats=k)
        mode.watching = True
        with mode:
            y = func(x)
        assert [v for key, v in rx._VERDICTS.items() if key[0] is func] == [verdict]
        assert (mode.partial, mode.expanded) == (partial, expanded)
        tall = func(rx.expand_operand(x, 1, k))  # DynamicCache's rows
        assert torch.equal(tall, y.expand_as(tall))
        assert rx.verdict_repeats(verdict, k) == (1 if verdict == "exact" else int(verdict.removeprefix("repeats:")))
    finally:
        rx.clear_verdicts()


def test_verdicts_name_repeats_on_the_ladder_only() -> None:
    assert rx.repeat_ladder(3) == [] and rx.repeat_ladder(4) == [2] and rx.repeat_ladder(64) == [2, 4, 8, 16, 32]
    assert rx.verdict_repeats("exact", 8) == 1 and rx.verdict_repeats("repeats:4", 8) == 4
    assert rx.verdict_repeats("repeats:8", 8) == 8  # every row: DynamicCache's
    assert rx.verdict_repeats("repeats:3", 8) is None and rx.verdict_repeats("maybe", 8) is None
    assert rx.verdict_repeats("expanded", 8) is None  # kept before the ladder was tried: proved again


@pytest.mark.threads(2)
def test_a_short_product_split_between_threads_gives_dynamic_cache_bits_on_fewer_rows() -> None:
    """The MLP's down projection of a 128-token prompt at two threads (SmolLM2's shapes): whatever
    this machine's BLAS does with one row, the probed call hands back the 64 rows' bits, and runs
    on fewer than 64 repeats where a proof admits them."""
    rx.clear_verdicts()
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(576, 1536, generator=g), requires_grad=False)
    x = torch.randn(1, 128, 1536, generator=g)
    k = 64
    try:
        mode = rx.RowExactness(prompts=1, repeats=k)
        mode.watching = True
        with mode:
            y = torch.nn.functional.linear(x, weight)
        big = torch.nn.functional.linear(rx.expand_operand(x, 1, k), weight)
        grouped = big.reshape(1, k, 128, 576)
        assert torch.equal(grouped, grouped[:, :1].expand_as(grouped))  # DynamicCache's own repeats agree
        assert torch.equal(y.reshape(1, 1, 128, 576).expand_as(grouped), grouped)
        (verdict,) = [v for key, v in rx._VERDICTS.items() if key[0] is torch.nn.functional.linear]
        assert rx.verdict_repeats(verdict, k) in [1, *rx.repeat_ladder(k), k]
        every = f"repeats:{k}"
        assert mode.expanded == (verdict == every) and mode.partial == (verdict not in ("exact", every))
    finally:
        rx.clear_verdicts()


def test_masked_or_non_causal_attention_at_two_threads_and_half_precision_run_on_every_row() -> None:
    """SDPA with an explicit mask, or not causal, on the host at more than one thread is never
    admitted on the unique rows (its result there was seen to depend on the values, which no draw
    settles: an encoder-decoder's first cross-attention, one query, no mask); neither is a
    half-precision matmul, attention or reduction at any thread count (its rounding hides a
    summation order but for a few values); causal float32 SDPA without a mask, or any at one
    thread, the proofs decide."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k = torch.randn(3, 2, 1, 16), torch.randn(3, 2, 11, 16)
    mask = torch.zeros(3, 2, 1, 11)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert rx._values_decide_rows(sdpa, (q, k, k), {"attn_mask": mask})
        assert rx._values_decide_rows(sdpa, (q, k, k, mask), {})
        assert rx._values_decide_rows(sdpa, (q, k, k), {})
        assert rx._values_decide_rows(sdpa, (q, k, k), {"is_causal": False})
        assert rx._values_decide_rows(sdpa, (q, k, k, None, 0.0, False), {})
        assert not rx._values_decide_rows(sdpa, (q, k, k), {"is_causal": True})
        assert not rx._values_decide_rows(sdpa, (q, k, k, None, 0.0, True), {})
        assert not rx._values_decide_rows(torch.nn.functional.linear, (q, k), {})
        torch.set_num_threads(1)
        assert not rx._values_decide_rows(sdpa, (q, k, k), {"attn_mask": mask})
        assert not rx._values_decide_rows(sdpa, (q, k, k), {})
        # half precision: every proved function at any thread count (the rounding hides a summation order)
        half = q.bfloat16()
        assert rx._values_decide_rows(torch.nn.functional.linear, (half, half[0, 0]), {})
        assert rx._values_decide_rows(torch.einsum, ("bhqd,bhkd->bhqk", half, half), {})
        assert rx._values_decide_rows(sdpa, (half, half, half), {"is_causal": True})
        assert not rx._values_decide_rows(torch.nn.functional.linear, (q, q[0, 0]), {})
        assert not rx._values_decide_rows(torch.nn.functional.silu, (half,), {})
    finally:
        torch.set_num_threads(before)

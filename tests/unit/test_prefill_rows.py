"""Prefill once, unit specs: which rows repeat, cutting inputs to one row per prompt and
expanding outputs back, and the matmul premise its exactness rests on."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_vkv.prefill_once import MIN_EXACT_ROWS, expand_rows, first_of_repeats, repeats_refusal


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("features", [(64, 128), (576, 1536)])
def test_a_row_of_a_matmul_of_min_exact_rows_equals_it_in_a_larger_one(dtype: torch.dtype, features: tuple) -> None:
    """The premise of prefill once on this CPU: from MIN_EXACT_ROWS rows on, a linear layer
    computes each row as it does inside a matmul of more rows (the same rows repeated). If this
    fails on another BLAS, prefill once must not be on by default there."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(features[1], features[0], generator=g).to(dtype)
    for rows in (MIN_EXACT_ROWS, 7, 64, 512):
        x = torch.randn(rows, features[0], generator=g).to(dtype)
        alone = torch.nn.functional.linear(x, weight)
        for k in (2, 8):
            inside = torch.nn.functional.linear(x.repeat_interleave(k, dim=0), weight)[::k]
            assert torch.equal(alone, inside), (rows, k)

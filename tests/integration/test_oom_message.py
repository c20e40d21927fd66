"""``KVCacheOutOfMemory`` states the whole step (contiguous and static layouts): what it needs in total, what is free, and a
``budget_bytes`` that fits it (it used to name the one sub-row page that failed last: "need
4,096 bytes, 0 free" for a step of hundreds of pages)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hf_vkv
from hf_vkv.generate import cache_kwarg
from models import prompts, tiny

pytestmark = pytest.mark.integration

PAGE = 4096


def _prefill(cache: Any, inputs: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        tiny("llama")(**inputs, **{cache_kwarg(): cache})


def _in_use(cache: Any) -> int:
    return sum(g.buffer.store.pool.stats().in_use for g in cache.groups)


@pytest.mark.parametrize("layout", ["head_major", "token_major", "static"])
def test_out_of_memory_gives_the_step_total_the_free_bytes_and_a_budget_that_fits(layout: str) -> None:
    config, inputs = tiny("llama").config, prompts(2, 40)
    extra = {"max_tokens": 64} if layout == "static" else {}
    free = hf_vkv.VKVCache(config=config, layout=layout, page_bytes=PAGE, **extra)
    _prefill(free, inputs)
    need = _in_use(free)  # what the prefill took with no budget
    assert need > 3
    small = hf_vkv.VKVCache(config=config, layout=layout, page_bytes=PAGE, budget_bytes=3 * PAGE, **extra)
    with pytest.raises(hf_vkv.KVCacheOutOfMemory) as caught:
        _prefill(small, inputs)
    error = caught.value
    assert (error.requested_bytes, error.free_bytes, error.budget_bytes, error.fits_bytes) == \
        (need * PAGE, 3 * PAGE, 3 * PAGE, need * PAGE)
    assert f"need {need * PAGE:,} bytes" in str(error) and f"at least {need * PAGE:,}" in str(error)
    assert int(small.get_seq_length()) == 0  # nothing changed
    fits = hf_vkv.VKVCache(config=config, layout=layout, page_bytes=PAGE, budget_bytes=error.fits_bytes, **extra)
    _prefill(fits, inputs)
    assert int(fits.get_seq_length()) == 40


def test_decode_step_counts_what_is_held() -> None:
    """A decode step that crosses page boundaries: the budget that fits is what is held plus the
    step's pages, and that budget lets the step run."""
    config, inputs = tiny("llama").config, prompts(2, 64)  # 64 tokens of 64 bytes: every sub-row ends on a page
    probe = hf_vkv.VKVCache(config=config, layout="head_major", page_bytes=PAGE)
    _prefill(probe, inputs)
    held = _in_use(probe)
    cache = hf_vkv.VKVCache(config=config, layout="head_major", page_bytes=PAGE, budget_bytes=held * PAGE)
    _prefill(cache, inputs)
    step = {"input_ids": torch.full((2, 1), 5), "attention_mask": torch.ones(2, 65, dtype=torch.long)}
    with pytest.raises(hf_vkv.KVCacheOutOfMemory) as caught:
        _prefill(cache, step)
    error = caught.value
    grown = error.requested_bytes // PAGE
    assert grown == 2 * 2 * 2 * 2  # rows x layers x (K, V) x kv heads: one new page per sub-row
    assert error.free_bytes == 0 and error.fits_bytes == (held + grown) * PAGE
    again = hf_vkv.VKVCache(config=config, layout="head_major", page_bytes=PAGE, budget_bytes=error.fits_bytes)
    _prefill(again, inputs)
    _prefill(again, step)
    assert again.get_seq_length() == 65


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("mode", [{}, {"num_beams": 3}, {"do_sample": True, "num_return_sequences": 3}])
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_a_generate_call_out_of_memory_names_a_budget_that_holds_the_whole_call(mode: dict[str, Any],
                                                                                 layout: str) -> None:
    """Inside ``generate`` the error's budget holds the whole call, not only the step that
    failed: retried with ``fits_bytes`` once, the call runs (a budget that fitted the prefill
    failed one token later, 25 tries for SmolLM2 greedy); tokens as DynamicCache's."""
    model, inputs = tiny("llama"), prompts(2, 30)

    def run(cache_config: dict[str, Any] | None) -> Any:
        torch.manual_seed(4)
        extra = {} if cache_config is None else {"cache_implementation": "vkv", "cache_config": cache_config}
        return model.generate(**inputs, max_new_tokens=20, min_new_tokens=20, **mode, **extra)

    options = {"layout": layout, "page_bytes": PAGE}
    with pytest.raises(hf_vkv.KVCacheOutOfMemory, match="holds the whole call") as caught:
        run({**options, "budget_bytes": 2 * PAGE})
    fits = caught.value.fits_bytes
    assert fits is not None and f"at least {fits:,}" in str(caught.value)
    assert torch.equal(run(None), run({**options, "budget_bytes": fits}))
    with pytest.raises(hf_vkv.KVCacheOutOfMemory):  # and it is not far above what the call needs
        run({**options, "budget_bytes": fits // 4})


def test_the_paged_layouts_generate_error_is_its_own() -> None:
    """The paged layout's blocks are not counted by the whole-call figure: its error stays the one
    its block store raised (its need and what is free), never a budget counted without it."""
    model = tiny("llama", attn="vkv_paged")
    with pytest.raises(hf_vkv.KVCacheOutOfMemory) as caught:
        model.generate(**prompts(8, 200), max_new_tokens=4, cache_implementation="vkv",
                       cache_config={"budget_bytes": 1 << 18})  # one page of the paged layout's 256 KiB
    assert "holds the whole call" not in str(caught.value)

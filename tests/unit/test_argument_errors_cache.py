"""A bad argument to a ``VKVCache`` call is a typed ``VKVError`` that still is the builtin class a
caller catches (``ArgumentError`` a ``ValueError``, ``ArgumentTypeError`` a ``TypeError``,
``CacheIndexError`` an ``IndexError``), names the argument and its valid range, and is raised
before anything changes: the cache then holds what it held and continues exactly as a
``DynamicCache`` fed the same tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import hf_vkv
from hf_vkv.cache.cache import RowSource
from hf_vkv.cache.group import WindowRollbackError
from hf_vkv.generate import cache_kwarg

_SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_SMALL)).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))


def _feed(model: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **{cache_kwarg(): cache}, use_cache=True).logits


def _prefilled(model: Any, ids: torch.Tensor) -> tuple[hf_vkv.VKVCache, DynamicCache]:
    cache, reference = hf_vkv.VKVCache(config=model.config), DynamicCache(config=model.config)
    assert torch.equal(_feed(model, cache, ids), _feed(model, reference, ids))
    return cache, reference


def _continues_exactly(model: Any, cache: hf_vkv.VKVCache, reference: DynamicCache, length: int, batch: int) -> None:
    """Nothing changed: the cache holds ``length`` tokens of ``batch`` rows, its bookkeeping holds,
    and two more steps give DynamicCache's logits bit for bit."""
    cache.check_invariants()
    assert cache.get_seq_length() == length and cache.rows == batch
    for step in range(2):
        nxt = torch.randint(0, 100, (batch, 1), generator=torch.Generator().manual_seed(10 + step))
        assert torch.equal(_feed(model, cache, nxt), _feed(model, reference, nxt))
    cache.check_invariants()


_K = torch.randn(2, 2, 1, 16, generator=torch.Generator().manual_seed(2))

#: (call on a cache holding 2 rows of 7 tokens, error class, builtin base, what the message says)
REFUSALS: dict[str, tuple[Callable[[hf_vkv.VKVCache], Any], type, type, str]] = {
    "fork(0)": (lambda c: c.fork(0), hf_vkv.ArgumentError, ValueError, r"fork\(length=0\).*1\.\.7"),
    "fork(8)": (lambda c: c.fork(8), hf_vkv.ArgumentError, ValueError, r"fork\(length=8\).*1\.\.7"),
    "fork(-1)": (lambda c: c.fork(-1), hf_vkv.ArgumentError, ValueError, r"fork\(length=-1\).*1\.\.7"),
    "fork('3')": (lambda c: c.fork("3"), hf_vkv.ArgumentTypeError, TypeError, r"fork\(length\) takes an int.*str"),
    "fork(3.5)": (lambda c: c.fork(3.5), hf_vkv.ArgumentTypeError, TypeError, r"fork\(length\) takes an int.*float"),
    "reorder past the batch": (lambda c: c.reorder_cache(torch.tensor([3, 0])), hf_vkv.CacheIndexError, IndexError,
                               r"beam_idx.*\[3\].*batch of 2.*0\.\.1"),
    "reorder negative": (lambda c: c.reorder_cache(torch.tensor([-1, 0])), hf_vkv.CacheIndexError, IndexError,
                         r"beam_idx.*\[-1\].*batch of 2"),
    "reorder float": (lambda c: c.reorder_cache(torch.tensor([1.0, 0.0])), hf_vkv.ArgumentTypeError, TypeError,
                      r"beam_idx.*float32.*long\(\)"),
    "select past the batch": (lambda c: c.batch_select_indices(torch.tensor([5])), hf_vkv.CacheIndexError,
                              IndexError, r"batch_select_indices: rows \[5\].*batch of 2 rows.*-2\.\.1"),
    "select a list past the batch": (lambda c: c.batch_select_indices([0, 5]), hf_vkv.CacheIndexError, IndexError,
                                     r"rows \[5\].*batch of 2"),
    "select negative past the batch": (lambda c: c.batch_select_indices(torch.tensor([-3])), hf_vkv.CacheIndexError,
                                       IndexError, r"rows \[-3\].*batch of 2"),
    "select a mask of another length": (lambda c: c.batch_select_indices(torch.tensor([True, False, True])),
                                        hf_vkv.CacheIndexError, IndexError, r"bool mask of shape \(3,\).*batch of 2"),
    "select float": (lambda c: c.batch_select_indices(torch.tensor([0.0])), hf_vkv.ArgumentTypeError, TypeError,
                     r"batch_select_indices.*float32"),
    "select strings": (lambda c: c.batch_select_indices(["a"]), hf_vkv.ArgumentTypeError, TypeError,
                       r"batch_select_indices takes row numbers"),
    "update past the layers": (lambda c: c.update(_K, _K, 99), hf_vkv.CacheIndexError, IndexError,
                               r"layer_idx 99 .* 2 layers, 0\.\.1"),
    "update negative past the layers": (lambda c: c.update(_K, _K, -3), hf_vkv.CacheIndexError, IndexError,
                                        r"layer_idx -3 .* 2 layers"),
    "write_states past the layers": (lambda c: c.write_states(99, _K, _K), hf_vkv.CacheIndexError, IndexError,
                                     r"write_states: layer_idx 99 .* 2 layers"),
    "write_states into a full layer": (lambda c: c.write_states(0, _K, _K), hf_vkv.ArgumentError, ValueError,
                                       r"already holds 7 tokens.*new cache"),
    "crop positive": (lambda c: c.crop(1), hf_vkv.ArgumentError, ValueError, r"positive value.*negative integer"),
    "crop a string": (lambda c: c.crop("x"), hf_vkv.ArgumentTypeError, TypeError, r"crop\(tokens_to_remove\).*int"),
    "repeat 0": (lambda c: c.batch_repeat_interleave(0), hf_vkv.ArgumentError, ValueError,
                 r"batch_repeat_interleave: repeats must be >= 1, got 0"),
    "repeat a string": (lambda c: c.batch_repeat_interleave("x"), hf_vkv.ArgumentTypeError, TypeError,
                        r"batch_repeat_interleave\(repeats\) takes an int"),
    "cut_to negative": (lambda c: c.cut_to(-1), hf_vkv.ArgumentError, ValueError, r"cut_to.*got length -1"),
    "take_rows into a full cache": (lambda c: c.take_rows([RowSource(c)], length=3), hf_vkv.ArgumentError, ValueError,
                                    r"take_rows fills an empty cache.*new VKVCache"),
    "take_over into a full cache": (lambda c: c.take_over(hf_vkv.VKVCache(config=c.config)), hf_vkv.ArgumentError,
                                    ValueError, r"take_over fills an empty cache"),
    "install_row into a full cache": (lambda c: c.install_row([]), hf_vkv.ArgumentError, ValueError,
                                      r"install_row fills an empty cache"),
    "row_images of 2 rows": (lambda c: c.row_images(), hf_vkv.ArgumentError, ValueError, r"batch-1 .* holds 2 rows"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refused_call_is_typed_and_changes_nothing(model: Any, ids: torch.Tensor, name: str) -> None:
    call, error, builtin, says = REFUSALS[name]
    cache, reference = _prefilled(model, ids)
    with pytest.raises(error, match=says) as info:
        call(cache)
    assert isinstance(info.value, hf_vkv.VKVError) and isinstance(info.value, builtin)
    _continues_exactly(model, cache, reference, length=7, batch=2)


@pytest.mark.parametrize("call, error, says", [
    (lambda layer: layer.crop("x"), hf_vkv.ArgumentTypeError, r"crop\(tokens_to_remove\) takes an int"),
    (lambda layer: layer.batch_repeat_interleave(2.0), hf_vkv.ArgumentTypeError, r"batch_repeat_interleave\(repeats\)"),
    (lambda layer: layer.reorder_cache(torch.tensor([3, 0])), hf_vkv.CacheIndexError, r"\[3\].*batch of 2"),
    (lambda layer: layer.batch_select_indices(torch.tensor([5])), hf_vkv.CacheIndexError, r"rows \[5\].*batch of 2"),
])
def test_a_layer_alone_in_its_group_refuses_the_same_way(model: Any, ids: torch.Tensor, call: Any, error: type,
                                                         says: str) -> None:
    """With groups='layer' a layer's own row operations are allowed; their bad arguments are
    refused as the cache's are, before anything changes."""
    cache, reference = hf_vkv.VKVCache(config=model.config, groups="layer"), DynamicCache(config=model.config)
    assert torch.equal(_feed(model, cache, ids), _feed(model, reference, ids))
    with pytest.raises(error, match=says):
        call(cache.layers[0])
    _continues_exactly(model, cache, reference, length=7, batch=2)


def test_the_calls_still_take_what_they_took(model: Any, ids: torch.Tensor) -> None:
    """What the checks accept: a negative row in a selection, a sequence, a 0-d integer tensor to crop."""
    cache, reference = _prefilled(model, ids)
    cache.batch_select_indices(torch.tensor([-1, 0]))
    reference.batch_select_indices(torch.tensor([-1, 0]))
    cache.crop(torch.tensor(-2))
    reference.crop(-2)
    cache.batch_select_indices([True, True])
    reference.batch_select_indices([True, True])
    fork = cache.fork(torch.tensor(3))
    assert fork.get_seq_length() == 3
    fork.close()
    _continues_exactly(model, cache, reference, length=5, batch=2)


# ------------------------------------------------------------------------------ an empty cache refusing
def test_take_rows_refuses_a_bad_source_before_anything_changes(model: Any, ids: torch.Tensor) -> None:
    source, _ = _prefilled(model, ids)
    cache = hf_vkv.VKVCache(config=model.config, memory_of=source)
    with pytest.raises(hf_vkv.ArgumentError, match=r"row source .* does not hold: take rows 0\.\.1") as info:
        cache.take_rows([RowSource(source, row=2)], length=3)
    assert isinstance(info.value, ValueError)
    with pytest.raises(hf_vkv.ArgumentTypeError, match="a row source must be a VKVCache") as info:
        cache.take_rows([RowSource(DynamicCache(config=model.config))], length=3)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    with pytest.raises(hf_vkv.ArgumentTypeError, match=r"take_rows\(length\) takes an int"):
        cache.take_rows([RowSource(source)], length=2.5)  # type: ignore[arg-type]
    with pytest.raises(hf_vkv.ArgumentError, match=r"length >= 1, got 1 rows of 0"):
        cache.take_rows([RowSource(source)], length=0)
    with pytest.raises(hf_vkv.ArgumentError, match="take_over takes the one row of a batch-1 cache"):
        cache.take_over(source)  # 2 rows
    with pytest.raises(hf_vkv.ArgumentError, match="0 group images for a cache of 1 groups"):
        cache.install_row([])
    assert cache.get_seq_length() == 0 and cache.rows == 0
    # the empty cache is as new: it takes a prompt and decodes as a DynamicCache does
    reference = DynamicCache(config=model.config)
    assert torch.equal(_feed(model, cache, ids), _feed(model, reference, ids))
    _continues_exactly(model, cache, reference, length=7, batch=2)
    # and the source is untouched
    source.check_invariants()
    assert source.get_seq_length() == 7 and source.rows == 2


def test_fork_of_an_empty_cache_says_so(model: Any) -> None:
    cache = hf_vkv.VKVCache(config=model.config)
    with pytest.raises(hf_vkv.ArgumentError, match=r"fork\(length=1\): the cache holds no tokens"):
        cache.fork(1)


# ------------------------------------------------------------------------------ a sliding window
def test_a_crop_behind_a_dropped_window_is_typed_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**_SMALL, sliding_window=4)).eval()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    cache, reference = _prefilled(model, ids)
    assert any(group.sliding_window == 4 for group in cache.groups)
    with pytest.raises(WindowRollbackError, match="activate_past_recording") as info:
        cache.crop(-1)
    assert isinstance(info.value, hf_vkv.VKVError) and isinstance(info.value, RuntimeError)
    _continues_exactly(model, cache, reference, length=7, batch=2)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_a_crop_into_tokens_dropped_before_recording_started_is_refused(layout: str) -> None:
    """``activate_past_recording()`` called only after the window passed, then a crop reaching
    back past what was kept: the crop went through, and the next step raised an untyped-sounding
    ``ArgumentError`` ("items ... are not mapped") with the cache broken (token-major, whose pages
    hold few tokens). Now the crop is refused, the cache as it was; a crop within what was kept
    still runs."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**_SMALL, sliding_window=8)).eval()
    cache = hf_vkv.VKVCache(model.config, layout=layout)
    ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache).logits
        for _ in range(20):
            logits = model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache).logits
    cache.activate_past_recording()
    held = next(g for g in cache.groups if g.sliding_window).first_written()
    limit = 320 - 8 + 1 - held  # the deepest crop whose window the kept tokens still cover
    if limit < 6:
        with pytest.raises(WindowRollbackError, match=r"crop\(-6\) would bring back tokens"):
            cache.crop(-6)
        assert cache.get_seq_length() == 320
        cache.check_invariants()
    else:  # head-major keeps whole 16-token pages: the crop is within them
        assert layout == "head_major"
    cache.crop(-min(limit, 6))
    cache.check_invariants()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5]]), past_key_values=cache)
    cache.check_invariants()


@pytest.mark.parametrize("grow", ["reorder_cache", "batch_select_indices", "select a list", "select a mask then more"])
def test_more_rows_than_made_grow_the_batch_as_dynamic_cache_does(model: Any, ids: torch.Tensor, grow: str) -> None:
    """Reordering or selecting more rows than the cache was made for grows its batch, as
    DynamicCache's ``index_select`` does (a fan-out of a prefilled row by hand: ``[0, 0, 0]``);
    the rows share the pages, and every later step gives DynamicCache's logits bit for bit. It was
    refused (``ArgumentError``: "rows asked of a cache created for 2")."""
    cache, reference = _prefilled(model, ids)
    index = torch.tensor([1, 0, 1, 1, 0])
    for c in (cache, reference):
        if grow == "reorder_cache":
            c.reorder_cache(index)
        elif grow == "batch_select_indices":
            c.batch_select_indices(index)
        elif grow == "select a list":
            c.batch_select_indices(index.tolist())
        else:
            c.batch_select_indices(torch.tensor([False, True]))
            c.batch_select_indices(torch.tensor([0, 0, 0, 0, 0]))
    _continues_exactly(model, cache, reference, length=7, batch=5)
    for c in (cache, reference):  # and back to fewer rows
        c.batch_select_indices(torch.tensor([4, 2]))
    _continues_exactly(model, cache, reference, length=9, batch=2)

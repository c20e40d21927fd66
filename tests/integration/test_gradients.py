"""Forwards with autograd on: every layout gives DynamicCache's logits and gradients.

A training-mode forward with ``labels`` and ``loss.backward()`` on a prefill, then one more
forward with labels over the cached prefix: logits and every parameter's gradient are
``torch.equal`` to the reference cache's (``DynamicCache``; ``StaticCache`` for the static
layout, whose attention reads the whole capacity). Cached tokens are data in vkv's pages, so the
reference's cached tensors are detached before the second forward (:mod:`hf_vkv.cache.grad`).
Where vkv cannot give a gradient asked for, :class:`hf_vkv.VKVGradientError` is raised.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicCache, StaticCache

import hf_vkv
from hf_vkv.generate import cache_kwarg
from models import VOCAB, tiny

pytestmark = pytest.mark.integration

PREFILL, MORE, CAPACITY = 10, 3, 32


@functools.cache
def _trainable(arch: str, attn: str) -> torch.nn.Module:
    """A training-mode copy of the tiny model (the shared ones are eval and must not change)."""
    model = copy.deepcopy(tiny(arch))
    model.set_attn_implementation(attn)
    return model.train()


def _ids(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2, length), generator=g)


def _step(model: torch.nn.Module, cache: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward with labels and ``loss.backward()``: ``(logits, {param name: grad})``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks (gpt2 trains with dropout)
    out = model(ids, labels=ids, **{cache_kwarg(): cache})
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _detach(cache: Any) -> None:
    """Make the reference's cached tensors data, as vkv's pages are."""
    for layer in cache.layers:
        if isinstance(layer.keys, torch.Tensor):
            layer.keys, layer.values = layer.keys.detach(), layer.values.detach()


def _assert_same(ref: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict], what: str) -> None:
    assert torch.equal(ref[0], got[0]), f"{what}: logits differ (max {(ref[0] - got[0]).abs().max()})"
    assert ref[1].keys() == got[1].keys(), f"{what}: gradients of different parameters"
    assert ref[1], f"{what}: no gradient at all"
    for name, grad in ref[1].items():
        assert torch.equal(grad, got[1][name]), f"{what}: grad of {name} differs (max {(grad - got[1][name]).abs().max()})"


@pytest.mark.parametrize("layout", ["head_major", "token_major", "paged", "static"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_train_forward_backward_equals_reference(arch: str, layout: str) -> None:
    if layout == "static" and arch == "gemma3":
        pytest.skip("the static layout pages full-attention layers only: gemma3's sliding layers are transformers' own")
    model = _trainable(arch, "vkv_paged" if layout == "paged" else "sdpa")
    assert torch.is_grad_enabled() and model.training
    if layout == "static":
        ref_cache: Any = StaticCache(config=model.config, max_cache_len=CAPACITY)
        vkv = hf_vkv.VKVCache(config=model.config, layout="static", max_tokens=CAPACITY)
    else:
        ref_cache = DynamicCache(config=model.config)
        vkv = hf_vkv.VKVCache(config=model.config, **({} if layout == "paged" else {"layout": layout}))
    first, more = _ids(PREFILL, 0), _ids(MORE, 1)
    _assert_same(_step(model, ref_cache, first), _step(model, vkv, first), "prefill")
    assert vkv.layout == layout
    _detach(ref_cache)
    _assert_same(_step(model, ref_cache, more), _step(model, vkv, more), "forward over the cached prefix")
    assert vkv.get_seq_length() == PREFILL + MORE
    vkv.check_invariants()


def test_default_session_forward_works() -> None:
    """The README's ``model(**prefix, past_key_values=cache)`` outside ``no_grad``, on an eval model
    whose parameters require grad (a ``from_pretrained`` model in a fresh session)."""
    model = tiny("llama")
    assert torch.is_grad_enabled() and next(model.parameters()).requires_grad
    ids = _ids(PREFILL, 2)
    ref = model(ids, **{cache_kwarg(): DynamicCache(config=model.config)}).logits
    got = model(ids, **{cache_kwarg(): hf_vkv.VKVCache(config=model.config)}).logits
    assert got.requires_grad and torch.equal(ref, got)


def test_trainable_prefix_states_are_refused() -> None:
    """A leaf tensor requiring grad written into the cache (prefix tuning) would lose its gradient
    in every later forward: refused with what to use instead; detached states are data."""
    model = tiny("llama")
    cache = hf_vkv.VKVCache(config=model.config)
    prefix = torch.zeros(2, 2, 4, 16, requires_grad=True)  # [B, Hkv, T, D] of the tiny llama
    with pytest.raises(hf_vkv.VKVGradientError, match="DynamicCache"):
        cache.update(prefix, prefix.detach(), 0)
    assert cache.get_seq_length() == 0  # refused before anything was stored
    with pytest.raises(hf_vkv.VKVGradientError, match="detach"):
        cache.write_states(0, prefix * 2, prefix.detach())
    keys, _ = cache.update(prefix.detach(), prefix.detach(), 0)
    assert keys.shape[2] == 4 and not keys.requires_grad
    with torch.no_grad():  # no gradient asked for: stored as data
        other = hf_vkv.VKVCache(config=model.config)
        other.update(prefix, prefix, 0)
        assert other.get_seq_length() == 4

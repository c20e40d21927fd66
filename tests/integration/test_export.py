"""torch.export of a tiny Llama whose ``past_key_values`` is a VKVCache.

What must hold: the export either works and the exported program computes what the eager model
computes with a DynamicCache (bit for bit), or it raises a typed hf_vkv error (a ``VKVError``) whose
message names vkv — never an error from torch's pytree that does not say what to do.

The way in is transformers' own pytree registration of every ``Cache`` subclass
(``register_cache_pytrees_for_model``, what transformers' exporter does; a DynamicCache past
exports with it). Pytree registration is process-global and cannot be undone, so the case without
any registration (where a DynamicCache past fails too) is not tested here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from breadth_models import tiny
from transformers.cache_utils import DynamicCache

import hf_vkv
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[3, 4, 5, 6]])
NEXT = torch.tensor([[7]])


class _Step(torch.nn.Module):
    """One decode step: ``(ids, past) -> logits``."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, past: Any) -> torch.Tensor:
        return self.model(input_ids=ids, **{cache_kwarg(): past}, use_cache=True).logits


def _prefilled(model: Any, cache: Any) -> Any:
    with torch.no_grad():
        model(input_ids=PROMPT, **{cache_kwarg(): cache}, use_cache=True)
    return cache


def _register_caches(model: Any) -> None:
    from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model

    register_cache_pytrees_for_model(model)


def _export_or_typed_error() -> None:
    model = tiny("llama")
    _register_caches(model)
    step = _Step(model)
    with torch.no_grad():
        expected = step(NEXT, _prefilled(model, DynamicCache(config=model.config)))
    try:
        program = torch.export.export(step, (NEXT, _prefilled(model, hf_vkv.VKVCache(model.config))), strict=False)
    except hf_vkv.VKVError as error:
        assert "vkv" in str(error).lower()
        return
    with torch.no_grad():
        got = program.module()(NEXT, _prefilled(model, hf_vkv.VKVCache(model.config)))
    assert torch.equal(expected, got)


def test_dynamic_cache_exports_with_transformers_registration() -> None:
    """The reference path works (so the VKV case below compares with something real)."""
    model = tiny("llama")
    _register_caches(model)
    step = _Step(model)
    program = torch.export.export(step, (NEXT, _prefilled(model, DynamicCache(config=model.config))), strict=False)
    with torch.no_grad():
        expected = step(NEXT, _prefilled(model, DynamicCache(config=model.config)))
        got = program.module()(NEXT, _prefilled(model, DynamicCache(config=model.config)))
    assert torch.equal(expected, got)


def test_export_vkv_past_with_transformers_registration() -> None:
    _export_or_typed_error()


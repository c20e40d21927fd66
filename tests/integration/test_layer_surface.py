"""The layer surface: every public method of transformers' ``DynamicLayer`` / ``CacheLayerMixin``
on a :class:`~hf_vkv.cache.layer.VKVLayer`.

The list is read from the running transformers (5.24: ``crop``, ``batch_*``, ``reorder_cache``,
``reset``, ``offload``, ``prefetch``, ...; 5.17 also ``get_max_cache_shape``); a name without a
case here fails the walk, so a new transformers release shows what it added. A layer alone in
its group (``groups="layer"``) does what ``DynamicLayer`` does (same keys, values and lengths,
``torch.equal``); a layer sharing its group refuses row operations with
:class:`hf_vkv.LayerCallError` naming the cache-level call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

import hf_vkv
from models import tiny

pytestmark = pytest.mark.integration

B, H, T, D = 3, 2, 5, 16  # the tiny llama's key/value heads and head dim


def _surface() -> set[str]:
    """Public methods of the running transformers' DynamicLayer and CacheLayerMixin."""
    return {name for cls in (CacheLayerMixin, DynamicLayer) for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and callable(member)}


def _states(seed: int, t: int = T, rows: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, H, t, D, generator=g), torch.randn(rows, H, t, D, generator=g)


def _pair(groups: str = "layer") -> tuple[DynamicLayer, Any, Any]:
    """A DynamicLayer and layer 0 of a VKVCache, both holding the same 5 tokens of 3 rows."""
    cache = hf_vkv.VKVCache(config=tiny("llama").config, groups=groups)
    dyn, vkv = DynamicLayer(), cache.layers[0]
    k, v = _states(0)
    ref, got = dyn.update(k, v), vkv.update(k, v)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    return dyn, vkv, cache


def _same(dyn: DynamicLayer, vkv: Any) -> None:
    assert vkv.get_seq_length() == dyn.get_seq_length()
    if dyn.keys is None or dyn.get_seq_length() == 0:
        return
    assert torch.equal(dyn.keys, vkv.keys) and torch.equal(dyn.values, vkv.values)
    k, v = _states(1, 1, dyn.keys.shape[0])  # and one more token lands in the same place
    assert all(torch.equal(a, b) for a, b in zip(dyn.update(k, v), vkv.update(k, v)))


def _crop(dyn: DynamicLayer, vkv: Any) -> None:
    dyn.crop(-2)
    vkv.crop(-2)
    _same(dyn, vkv)
    with pytest.raises(ValueError, match="negative integer"):
        vkv.crop(1)  # 5.23+ DynamicLayer raises too (5.17 warned and cut to an absolute length)


def _compare(call: Callable[[Any], Any]) -> Callable[[DynamicLayer, Any], None]:
    """Call ``call`` on both layers: equal results, then equal contents."""
    def case(dyn: DynamicLayer, vkv: Any) -> None:
        assert call(dyn) == call(vkv)
        _same(dyn, vkv)
    return case


def _reset(dyn: DynamicLayer, vkv: Any) -> None:
    dyn.reset()
    vkv.reset()
    if dyn.get_seq_length():  # 5.17 zeroed the tensors in place and kept their length; 5.23+ drops them
        dyn = DynamicLayer()
    _same(dyn, vkv)
    assert vkv.get_seq_length() == 0


def _offload_prefetch(dyn: DynamicLayer, vkv: Any) -> None:
    for layer in (dyn, vkv):
        layer.offload()
        layer.prefetch()
    _same(dyn, vkv)


def _lazy_initialization(dyn: DynamicLayer, vkv: Any) -> None:
    assert dyn.is_initialized and vkv.is_initialized
    assert (vkv.dtype, vkv.device) == (dyn.keys.dtype, dyn.device)
    _same(dyn, vkv)


#: What each public DynamicLayer / CacheLayerMixin method does on both layers.
CASES: dict[str, Callable[[DynamicLayer, Any], None]] = {
    "update": lambda dyn, vkv: _same(dyn, vkv),
    "lazy_initialization": _lazy_initialization,
    "get_seq_length": _compare(lambda layer: layer.get_seq_length()),
    "get_mask_sizes": _compare(lambda layer: layer.get_mask_sizes(4)),
    "get_max_length": _compare(lambda layer: layer.get_max_length()),
    "get_max_cache_shape": _compare(lambda layer: layer.get_max_cache_shape()),  # 5.17, deprecated there
    "crop": _crop,
    "reorder_cache": _compare(lambda layer: layer.reorder_cache(torch.tensor([2, 0, 0], dtype=torch.int32))),
    "batch_select_indices": _compare(lambda layer: layer.batch_select_indices(torch.tensor([0, 2]))),
    "batch_repeat_interleave": _compare(lambda layer: layer.batch_repeat_interleave(2)),
    "reset": lambda dyn, vkv: _reset(dyn, vkv),
    "offload": _offload_prefetch,
    "prefetch": _offload_prefetch,
}
#: Row operations: refused on a layer that shares its group, naming the cache's call.
ROW_OPERATIONS = {
    "crop": lambda layer: layer.crop(-1),
    "reorder_cache": lambda layer: layer.reorder_cache(torch.tensor([1, 0, 2])),
    "batch_select_indices": lambda layer: layer.batch_select_indices(torch.tensor([0])),
    "batch_repeat_interleave": lambda layer: layer.batch_repeat_interleave(2),
    "reset": lambda layer: layer.reset(),
}


def test_every_method_of_the_running_transformers_has_a_case() -> None:
    missing = sorted(_surface() - set(CASES))
    assert not missing, (f"transformers added DynamicLayer/CacheLayerMixin method(s) {missing}: make VKVLayer behave "
                         f"as DynamicLayer does, or raise a typed error naming the cache-level call, and add a case")
    assert {"crop", "reorder_cache", "reset", "get_mask_sizes"} <= _surface()  # the walk reads a real list


@pytest.mark.parametrize("name", sorted(_surface()))
def test_layer_alone_in_its_group_behaves_as_dynamic_layer(name: str) -> None:
    dyn, vkv, cache = _pair()
    CASES[name](dyn, vkv)
    cache.check_invariants()


@pytest.mark.parametrize("name", sorted(ROW_OPERATIONS))
def test_layer_sharing_its_group_names_the_cache_call(name: str) -> None:
    dyn, vkv, cache = _pair(groups="kind")
    assert len(vkv.group.members) == 2
    with pytest.raises(hf_vkv.LayerCallError, match=rf"VKVCache\.{name}"):
        ROW_OPERATIONS[name](vkv)
    assert vkv.get_seq_length() == T and torch.equal(vkv.keys, dyn.keys)  # refused before anything changed
    ROW_OPERATIONS[name](cache)  # the cache-level call does it
    cache.check_invariants()


def test_static_layer_refuses_row_operations_by_itself() -> None:
    cache = hf_vkv.VKVCache(config=tiny("llama").config, layout="static", max_tokens=16, groups="layer")
    cache.update(*_states(0), 0)
    with pytest.raises(hf_vkv.LayerCallError, match=r"VKVCache\.crop"):
        cache.layers[0].crop(-1)

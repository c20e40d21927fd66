"""Tee: the VKV cache and a DynamicCache run side by side inside one ``generate()``.

``TeeCache`` is a :class:`VKVCache` that also feeds every call it gets to a ``DynamicCache``
shadow with the same inputs, and checks at each call that the answers are identical:

* every ``update`` of every layer returns exactly (``torch.equal``, same shape and dtype) the K/V
  the DynamicCache returns, and afterwards the layer's cached ``keys``/``values`` equal the
  shadow layer's;
* ``get_mask_sizes``, ``get_seq_length`` and ``get_query_offset`` return the same numbers;
* ``reorder_cache`` / ``crop`` / ``batch_*`` / ``reset`` go to both.

The generate wrapper is made to build a ``TeeCache`` instead of a ``VKVCache``, so the cache sees
exactly what ``cache_implementation="vkv"`` gives it (row count, prompt repeats, options).

Every test runs in both layouts. In the paged one (model on the ``"vkv_paged"`` attention, blocks
of 4 tokens) ``update`` returns the new states tagged for the paged attention, so what is
compared at each update is what that attention reads: the layer's tokens gathered through the
block tables of the tag.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from models import (
    LayoutRun,
    SMALL_PAGE,
    assert_same_tokens,
    assistant,
    assistant_keeps_cache_implementation,
    needs_sliding_rollback,
    prompts,
    tiny,
)
from transformers.cache_utils import DynamicCache

import hf_vkv.generate.registry as registration
from hf_vkv.devices import policy_for
from hf_vkv.generate import cache_kwarg
from hf_vkv import VKVCache
from hf_vkv.attention.kernels import gather_kv
from hf_vkv.attention import KV_TAG

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("layout")]


def options(layout: LayoutRun) -> dict[str, int]:
    """The VKV cache options of these tests in the current layout."""
    return {"page_bytes": SMALL_PAGE, **layout.config()}


class TeeCache(VKVCache):
    """A VKVCache checked against a DynamicCache shadow at every call (see the module docstring)."""

    instances: list[TeeCache] = []

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.shadow = DynamicCache(config=config)
        self.calls: Counter[str] = Counter()
        TeeCache.instances.append(self)

    def _same(self, what: str, got: Any, expected: Any) -> Any:
        assert got == expected, f"{what}: VKV says {got}, DynamicCache says {expected} (after {dict(self.calls)})"
        return got

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        exp_k, exp_v = self.shadow.update(key_states.clone(), value_states.clone(), layer_idx, *args, **kwargs)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        seen = keys, values
        tag = getattr(keys, KV_TAG, None)
        if tag is not None:  # the fused kernel's paged layer: what the vkv_paged attention reads
            seen = gather_kv(tag)
        step = f"update #{self.calls['update']} of layer {layer_idx} (q={key_states.shape[2]})"
        for name, got, exp in (("keys", seen[0], exp_k), ("values", seen[1], exp_v)):
            assert got.shape == exp.shape, f"{step}: {name} {tuple(got.shape)} vs {tuple(exp.shape)}"
            assert got.dtype == exp.dtype
            assert torch.equal(got, exp), f"{step}: returned {name} differ"
        mine, ref = self.layers[layer_idx], self.shadow.layers[layer_idx]
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values), f"{step}: stored K/V"
        self.calls["update"] += 1
        return keys, values

    def get_mask_sizes(self, query_length: int, layer_idx: int, *args: Any) -> tuple[int, int]:
        self.calls["get_mask_sizes"] += 1
        return self._same(f"get_mask_sizes({query_length}, {layer_idx})",
                          super().get_mask_sizes(query_length, layer_idx, *args),
                          self.shadow.get_mask_sizes(query_length, layer_idx, *args))

    def get_seq_length(self, layer_idx: int = 0, *args: Any) -> int:
        self.calls["get_seq_length"] += 1
        return self._same(f"get_seq_length({layer_idx})", super().get_seq_length(layer_idx, *args),
                          self.shadow.get_seq_length(layer_idx, *args))

    def get_query_offset(self, layer_idx: int = 0) -> int:
        got = super().get_query_offset(layer_idx)
        if hasattr(self.shadow, "get_query_offset"):  # transformers >= 5.18
            self._same(f"get_query_offset({layer_idx})", got, self.shadow.get_query_offset(layer_idx))
        return got

    def _both(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls[name] += 1
        getattr(super(), name)(*args, **kwargs)
        getattr(self.shadow, name)(*args, **kwargs)
        self.compare_all(name)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._both("reorder_cache", beam_idx)

    def crop(self, max_length: int) -> None:
        self._both("crop", max_length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._both("batch_select_indices", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._both("batch_repeat_interleave", repeats)

    def activate_past_recording(self, **kwargs: Any) -> None:  # (5.25: recurrent_states_to_keep=)
        self._both("activate_past_recording", **kwargs)

    def compare_all(self, after: str) -> None:
        """Every layer's cached K/V equal the shadow's (unless a sliding layer records its past)."""
        for i, (mine, ref) in enumerate(zip(self.layers, self.shadow.layers)):
            assert mine.get_seq_length() == ref.get_seq_length(), f"after {after}: layer {i} length"
            if ref.is_initialized and not getattr(ref, "record_past", False):
                assert torch.equal(mine.keys, ref.keys), f"after {after}: layer {i} keys"
                assert torch.equal(mine.values, ref.values), f"after {after}: layer {i} values"


@pytest.fixture
def tee(monkeypatch: pytest.MonkeyPatch) -> type[TeeCache]:
    """Make ``cache_implementation="vkv"`` build TeeCaches for this test."""
    TeeCache.instances = []
    monkeypatch.setattr(registration, "VKVCache", TeeCache)
    return TeeCache


def _run(layout: LayoutRun, model: Any, inputs: dict[str, torch.Tensor], seed: int = 0, **kwargs: Any) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    ref = model.generate(**inputs, **kwargs)
    torch.manual_seed(seed)
    with layout.attention(model):
        got = model.generate(**inputs, cache_implementation="vkv", cache_config=options(layout),
                             return_dict_in_generate=True, **kwargs)
    assert_same_tokens(ref, got.sequences)
    return ref, got


CASES = {
    "greedy-llama": ("llama", dict(do_sample=False), dict(left_pad=[0, 4])),
    "beam-llama": ("llama", dict(num_beams=4, num_return_sequences=2, do_sample=False), dict(left_pad=[0, 3])),
    "sample-qwen2": ("qwen2", dict(do_sample=True, num_return_sequences=3, temperature=1.5), dict(left_pad=[2, 0])),
    "greedy-mistral-window": ("mistral", dict(do_sample=False), dict(left_pad=[0, 5])),
    "beam-mistral-window": ("mistral", dict(num_beams=3, do_sample=False), dict(left_pad=[0, 1])),
    "beam-gemma3-mixed": ("gemma3", dict(num_beams=4, num_return_sequences=4, do_sample=False), dict(left_pad=[4, 0])),
    "greedy-gpt2": ("gpt2", dict(do_sample=False), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tee_generate(layout: LayoutRun, tee: type[TeeCache], case: str) -> None:
    arch, kwargs, prompt_kwargs = CASES[case]
    model = tiny(arch)
    _, got = _run(layout, model, prompts(2, 10, seed=21, **prompt_kwargs), max_new_tokens=20, **kwargs)
    (cache,) = tee.instances
    assert got.past_key_values is cache and cache.layout == layout.name
    n_layers = model.config.num_hidden_layers
    assert cache.calls["update"] == 20 * n_layers  # prefill + 19 decode steps, every layer checked
    assert cache.calls["get_mask_sizes"] >= 20
    if "num_beams" in kwargs:
        assert cache.calls["reorder_cache"] == 20
        assert cache.stats().cow_copies + cache.stats().tail_copies > 0  # copied at a write or a reorder
    cache.compare_all("generate")
    cache.check_invariants()


@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma3", marks=needs_sliding_rollback)])
def test_tee_assisted(layout: LayoutRun, tee: type[TeeCache], arch: str) -> None:
    """Assisted decoding: many-token updates and crops, on the main cache and the assistant's."""
    _run(layout, tiny(arch), prompts(1, 9, seed=22), max_new_tokens=30, do_sample=False, assistant_model=assistant(arch))
    if assistant_keeps_cache_implementation():
        assert len(tee.instances) == 2  # the main model's and the assistant's (whose attention is sdpa)
        # the assistant's attention is sdpa: under the paged run its cache takes a contiguous layout,
        # the one the layout rule gives its workload (a short prompt: head-major or token-major)
        own = {policy_for("cpu").layout, "token_major"} if layout.name == "paged" else {layout.name}
        assert tee.instances[0].layout == layout.name and tee.instances[1].layout in own, \
            [c.layout for c in tee.instances]
    else:  # transformers >= 5.24 gives the assistant its own DynamicCache
        assert [c.layout for c in tee.instances] == [layout.name]
    for cache in tee.instances:
        assert cache.calls["crop"] > 0 and cache.calls["update"] > 0
        cache.check_invariants()


def test_tee_manual_loop_with_row_operations(layout: LayoutRun) -> None:
    """A hand-written decode loop on gemma3 (mixed window layers) with every row operation in between."""
    model = tiny("gemma3")
    with layout.attention(model):
        _manual_loop(layout, model)


def _manual_loop(layout: LayoutRun, model: Any) -> None:
    cache = TeeCache(model.config, **options(layout))
    inputs = prompts(3, 7, seed=23, left_pad=[0, 2, 5])
    ids, mask = inputs["input_ids"], inputs["attention_mask"]

    def step(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **{cache_kwarg(): cache})
        return out.logits[:, -1].argmax(-1, keepdim=True)

    nxt = step(ids, mask)
    for t in range(14):
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        nxt = step(nxt, mask)
        if t == 3:
            cache.batch_repeat_interleave(2)  # 6 rows, pairs share pages
            mask, nxt = mask.repeat_interleave(2, 0), nxt.repeat_interleave(2, 0)
        if t == 6:
            keep = torch.tensor([0, 3, 4, 5])
            cache.batch_select_indices(keep)
            mask, nxt = mask[keep], nxt[keep]
        if t == 9:
            cache.reorder_cache(torch.tensor([1, 1, 3, 0], dtype=torch.int32))
            mask, nxt = mask[[1, 1, 3, 0]], nxt[[1, 1, 3, 0]]
    cache.compare_all("loop")
    assert cache.calls["update"] == 15 * model.config.num_hidden_layers
    cache.check_invariants()


def _reset_both(cache: TeeCache) -> None:
    cache.reset()
    cache.shadow.reset()
    if any(layer.keys is not None and layer.keys.numel() for layer in cache.shadow.layers):
        # transformers 5.17's DynamicLayer.reset() zeroes the K/V but keeps them (a later update
        # appends after the zeros); compare with an empty DynamicCache, which later versions reset to
        cache.shadow = DynamicCache(config=cache.config)


def _prefill(cache: TeeCache, model: Any, batch: int, length: int, seed: int) -> None:
    inputs = prompts(batch, length, seed=seed)
    with torch.no_grad():
        model(**inputs, **{cache_kwarg(): cache})


def _decode(cache: TeeCache, model: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = cache.layers[0].keys.shape[0]
        ids = torch.randint(3, 500, (batch, 1), generator=g)
        pos = torch.full((batch, 1), cache.get_seq_length())
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos, **{cache_kwarg(): cache})


@pytest.mark.parametrize("arch", ["llama", pytest.param("mistral", marks=needs_sliding_rollback)])
def test_row_operations_match_dynamic_cache(layout: LayoutRun, arch: str) -> None:
    """crop(-n), batch_select_indices (index tensor, list, bool mask, negative index),
    batch_repeat_interleave and reset leave the same K/V as in DynamicCache (compared after each),
    and decoding on top of them stays identical."""
    model = tiny(arch)
    with layout.attention(model):
        _row_operations(layout, model, arch)


def _row_operations(layout: LayoutRun, model: Any, arch: str) -> None:
    cache = TeeCache(model.config, **options(layout))
    if arch == "mistral":
        cache.activate_past_recording()  # a sliding window can be cropped back only when recording
    _prefill(cache, model, 3, 11, seed=31)
    _decode(cache, model, 4, seed=32)
    cache.crop(-3)
    cache.crop(0)
    _decode(cache, model, 2, seed=33)
    cache.batch_repeat_interleave(2)  # 6 rows
    _decode(cache, model, 3, seed=34)
    for index in (torch.tensor([5, 0, 2, 3]), [3, 1, 0], torch.tensor([True, False, True]), torch.tensor([-1, 0])):
        cache.batch_select_indices(index)
        _decode(cache, model, 2, seed=35)
    assert cache.layers[0].keys.shape[0] == 2
    cache.crop(-5)
    _decode(cache, model, 9, seed=36)  # past the window again after the crop
    cache.check_invariants()
    _reset_both(cache)
    cache.compare_all("reset")
    assert cache.get_seq_length() == 0 and cache.stats().resident_bytes == 0
    _prefill(cache, model, 4, 5, seed=37)  # reusable after a reset, with a larger batch (as DynamicCache)
    _decode(cache, model, 3, seed=38)
    cache.compare_all("reuse")
    cache.check_invariants()


def test_reset_then_larger_batch(layout: LayoutRun) -> None:
    """After reset() a DynamicCache takes any batch; so does the VKV cache (and writes no stale rows)."""
    model = tiny("gemma3")
    with layout.attention(model):
        cache = TeeCache(model.config, **options(layout))
        _prefill(cache, model, 2, 9, seed=39)
        _decode(cache, model, 6, seed=40)
        _reset_both(cache)
        _prefill(cache, model, 5, 8, seed=41)
        _decode(cache, model, 6, seed=42)
    cache.compare_all("larger batch after reset")
    assert cache.layers[0].keys.shape[0] == 5
    cache.check_invariants()


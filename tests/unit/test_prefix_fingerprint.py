"""The weights fingerprint: every parameter sampled within its bounds, however large it is; the
values read again at each call; the state of adapter layers.

SmolLM2's embedding has 28,311,552 values: evenly spaced indices computed with a float32
``torch.linspace`` rounded the last one up to 28,311,552, past the end (``IndexError`` in
``save_prefix(..., model=model)`` and ``PrefixStore.save(..., model=model)``).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import LlamaConfig

from hf_vkv import PrefixStore
from hf_vkv.prefix.fingerprint import (adapter_state, computation_state, earlier_fingerprints, weights_fingerprint,
                                       weights_match)

SMOLLM2_EMBEDDING = 49152 * 576  # 28,311,552 values: past float32's 2**24 exact integers


def _model(numel: int) -> torch.nn.Module:
    module = torch.nn.Module()
    # int8 keeps the tensor at 28 MB; the fingerprint samples any dtype as float32
    module.weight = torch.nn.Parameter(torch.zeros(numel, dtype=torch.int8), requires_grad=False)
    return module


def test_a_parameter_past_float32_exact_integers_is_fingerprinted() -> None:
    assert torch.linspace(0, SMOLLM2_EMBEDDING - 1, 256)[-1].long() >= SMOLLM2_EMBEDDING  # the old bug's cause
    model = _model(SMOLLM2_EMBEDDING)
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    with torch.no_grad():
        model.weight[-1] = 1  # the last value is sampled
    assert weights_fingerprint(model) != before


def test_small_parameters_are_sampled_whole() -> None:
    for numel in (1, 2, 255, 256, 257):
        model = _model(numel)
        before = weights_fingerprint(model)
        with torch.no_grad():
            model.weight[-1] = 3
        assert weights_fingerprint(model) != before, numel


def _sample(n: int, *, blocks: int) -> torch.Tensor:
    """The definition of the sampled indices: all up to 256, else ``blocks`` runs of 256 / blocks
    consecutive values, the runs' starts evenly spaced from 0 to ``n - 256 / blocks``."""
    if n <= 256:
        return torch.arange(n)
    width = 256 // blocks
    return torch.cat([torch.arange(width) + i * (n - width) // (blocks - 1) for i in range(blocks)])


def _reference(model: torch.nn.Module, *, blocks: int = 8) -> str:
    """The fingerprint's definition in plain torch indexing (``blocks=256``: 256 evenly spaced
    values, what files written by earlier versions hold)."""
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = param.detach().reshape(-1)
        h.update(f"{name}:{tuple(param.shape)};".encode())
        h.update(flat[_sample(flat.numel(), blocks=blocks)].float().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_the_fingerprint_reads_the_values_torch_indexing_reads(dtype: torch.dtype) -> None:
    """CPU tensors numpy can hold are sampled through numpy, the rest through torch: both give
    the definition's bytes, and those of the earlier versions' definition (a file saved before
    keeps matching its model)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 7), torch.nn.Embedding(1000, 33))
    for name, param in list(model.named_parameters()):  # Module.to takes floating dtypes only
        module, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(module, leaf, torch.nn.Parameter((param.detach() * 50).to(dtype), requires_grad=False))
    assert weights_fingerprint(model) == _reference(model)
    assert earlier_fingerprints(model) == (_reference(model, blocks=256),) * 2  # no buffers: both the same
    assert weights_match(_reference(model, blocks=256), model) and not weights_match(_reference(model[:1]), model)


def test_the_sample_covers_both_ends_and_runs_of_values() -> None:
    """Every value of a run is read, the first and the last value included, the runs do not
    overlap, and a write between the runs goes unseen (a sample, not a proof)."""
    n = 1000
    index = _sample(n, blocks=8)
    assert len(set(index.tolist())) == 256 and index[0] == 0 and index[-1] == n - 1
    model = _model(n)
    before = weights_fingerprint(model)
    for i in (0, 31, n - 32, n - 1):
        with torch.no_grad():
            model.weight[i] = 5
        assert weights_fingerprint(model) != before, i
        with torch.no_grad():
            model.weight[i] = 0
    assert weights_fingerprint(model) == before
    gap = int(index[32]) - 1  # between the first run and the second
    with torch.no_grad():
        model.weight[gap] = 5
    assert weights_fingerprint(model) == before


def test_a_write_through_param_data_is_seen_at_every_call() -> None:
    """``param.data`` writes bump no version counter: a store's fingerprint is taken anew at
    each call, so the second call sees the write a remembered one missed."""
    model = torch.nn.Linear(64, 64)
    store = PrefixStore(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=100))
    before = store.fingerprint(model)
    version = model.weight._version
    model.weight.data[-1, -1] += 1  # the last value is sampled
    assert model.weight._version == version
    assert store.fingerprint(model) != before


class _AdapterLayer(torch.nn.Module):
    """An adapter layer by the interface the fingerprint reads (peft's tuner layers')."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(8, 8)
        self.active, self.disabled, self.merged_adapters, self.scaling = ["x"], False, [], {"x": 2.0, "y": 1.0}

    @property
    def active_adapters(self) -> list[str]:
        return self.active

    @property
    def disable_adapters(self) -> bool:
        return self.disabled


def test_the_adapter_state_is_part_of_the_fingerprint() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert adapter_state(plain) == [] and weights_fingerprint(plain) == _reference(plain)
    model = torch.nn.Sequential(_AdapterLayer())
    layer = model[0]
    seen = {weights_fingerprint(model)}
    for change in (lambda: setattr(layer, "active", ["y"]), lambda: setattr(layer, "disabled", True),
                   lambda: layer.merged_adapters.append("y"), lambda: layer.scaling.update(y=0.5)):
        change()
        seen.add(weights_fingerprint(model))
    assert len(seen) == 5  # each change is seen, with no parameter changed
    assert adapter_state(model) == [[["y"], True, ["y"], [0.5]]]


@pytest.mark.parametrize(("attention", "state"), [
    (None, {}), ("sdpa", {}), ("vkv_paged", {}), ("eager", {"attention": "eager"}),
    ("vkv_cascade", {"attention": "vkv_cascade"}),
])
def test_an_attention_other_than_sdpa_is_part_of_the_fingerprint(attention: str | None, state: dict) -> None:
    """Each layer's K/V after the first come from the attention before them: an implementation
    whose outputs differ from sdpa's in their last bits fingerprints apart; sdpa's class (and an
    unset one, transformers' default) as the parameters alone."""
    model = torch.nn.Linear(8, 8)
    model.config = LlamaConfig()
    model.config._attn_implementation_internal = attention
    assert computation_state(model) == state
    assert (weights_fingerprint(model) == _reference(model)) == (not state)


def test_hooks_added_by_another_thread_meanwhile_are_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's ``generate`` adds and removes prefill once's hooks on a module while this
    thread's fingerprint reads its hook tables: a dict that changes size while Python iterates it
    raised ``RuntimeError: OrderedDict mutated during iteration``. A hook added between two items
    read (what a thread switch there does) is no error now."""
    import hf_vkv.prefix.fingerprint as fingerprint

    model = torch.nn.Linear(4, 4)
    for _ in range(3):
        model.register_forward_hook(lambda *a: None)
    real = fingerprint._from_library
    added: list[object] = []

    def switch_here(hook: object) -> bool:  # another thread registers a hook between two items
        if not added:
            added.append(model.register_forward_hook(lambda *a: None))
        return real(hook)

    monkeypatch.setattr(fingerprint, "_from_library", switch_here)
    assert len(computation_state(model)["hooks"]) >= 3  # the user's hooks are seen
    assert added

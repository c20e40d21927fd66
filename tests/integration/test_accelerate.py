"""accelerate offloading: with a ``device_map`` that puts decoder layers on "cpu" and on "disk"
(accelerate hooks load the disk layer's weights at each forward), or a whole model offloaded, the
VKV cache gives the same tokens as DynamicCache, and as the model without offloading; a prefix
store steps aside where weights are off the model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from models import SMALL_PAGE, assert_same_tokens, generate_both, prompts, tiny
from transformers import AutoModelForCausalLM

from hf_vkv import PrefixStore, VKVCache, reuse_report

pytest.importorskip("accelerate")

pytestmark = pytest.mark.integration


def _offloaded(arch: str, tmp_path: Path) -> Any:
    base = tiny(arch, layers=3)
    base.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload"))
    model.eval()
    assert model.hf_device_map["model.layers.1"] == "disk"
    assert hasattr(model.model.layers[1], "_hf_hook")  # accelerate's AlignDevicesHook does the loading
    # the disk layer's weights are not in memory: the hook reads them from the checkpoint at each forward
    assert {p.device.type for p in model.model.layers[1].parameters()} == {"meta"}
    assert {p.device.type for p in model.model.layers[0].parameters()} == {"cpu"}
    model.generation_config = base.generation_config
    return base, model


_MODES: dict[str, dict[str, Any]] = {
    "greedy-padded": {"do_sample": False},
    "beam": {"num_beams": 4, "num_return_sequences": 2, "do_sample": False},
    "sample": {"do_sample": True, "num_return_sequences": 2, "temperature": 1.5},
}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("mode", ["greedy-padded", "beam", "sample"])
def test_cpu_and_disk_offload(tmp_path: Path, arch: str, mode: str) -> None:
    base, model = _offloaded(arch, tmp_path)
    inputs = prompts(2, 9, seed=41, left_pad=[0, 3])
    kwargs = _MODES[mode]
    ref, got = generate_both(model, inputs, max_new_tokens=16, vkv={"page_bytes": SMALL_PAGE}, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    torch.manual_seed(0)
    plain = base.generate(**inputs, max_new_tokens=16, **kwargs)
    assert_same_tokens(plain, got.sequences)  # offloading changes nothing either
    cache = got.past_key_values
    assert isinstance(cache, VKVCache)
    assert all(layer.device == torch.device("cpu") for layer in cache.layers)
    cache.check_invariants()


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
@pytest.mark.parametrize("mode", ["greedy-padded", "beam", "sample"])
def test_a_whole_model_offloaded(tmp_path: Path, offload: str, mode: str) -> None:
    """accelerate's ``cpu_offload`` / ``disk_offload`` keep every weight off the model (its
    parameters on the ``meta`` device, ``model.device`` too) and move them in at each forward: the
    cache's device is the forward's, known at its first update. It was refused
    (``UnsupportedDeviceError``: "key/value states are on meta")."""
    import accelerate

    base = tiny("llama", layers=3)
    model = copy.deepcopy(base)
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device=torch.device("cpu"))
    assert model.device.type == "meta"
    inputs = prompts(2, 9, seed=41, left_pad=[0, 3])
    outs = []
    for extra in ({}, {"cache_implementation": "vkv"}):  # the user's call: default options
        torch.manual_seed(0)
        outs.append(model.generate(**inputs, max_new_tokens=16, output_logits=True, return_dict_in_generate=True,
                                   **_MODES[mode], **extra))
    ref, got = outs
    assert_same_tokens(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits, strict=True):
        assert torch.equal(a, b)
    cache = got.past_key_values
    assert isinstance(cache, VKVCache)
    assert all(layer.device == torch.device("cpu") for layer in cache.layers)
    cache.check_invariants()


@pytest.mark.parametrize("offload", ["device_map", "cpu_offload"])
def test_a_prefix_store_steps_aside_for_weights_off_the_model(tmp_path: Path, offload: str) -> None:
    """A store's weights fingerprint reads the parameters, and weights on the ``meta`` device
    (a layer offloaded to disk, a whole model offloaded) have none to read: the store steps aside
    with a refusal naming it, and the tokens are DynamicCache's. It failed inside the fingerprint
    (``NotImplementedError``: "Cannot copy out of meta tensor") or at the cache's device."""
    import accelerate

    if offload == "device_map":
        _, model = _offloaded("llama", tmp_path)
    else:
        model = copy.deepcopy(tiny("llama", layers=3))
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    store = PrefixStore(model.config)
    ids = prompts(1, 20, seed=3)["input_ids"]
    for _ in range(2):
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             return_dict_in_generate=True)
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             return_dict_in_generate=True, cache_implementation="vkv",
                             cache_config={"prefix_store": store})
        assert_same_tokens(ref.sequences, got.sequences)
        report = reuse_report(got)
        assert report.reused_tokens == 0 and "meta device" in report.refusal, report
        assert len(store) == 0
        ids = torch.cat([got.sequences[:, :-1], prompts(1, 4, seed=4)["input_ids"]], dim=1)
    store.check_invariants()

"""accelerate offloading: with a ``device_map`` that puts decoder layers on "cpu" and on "disk"
(accelerate hooks load the disk layer's weights at each forward), the VKV cache gives the same
tokens as DynamicCache, and as the model without offloading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import SMALL_PAGE, assert_same_tokens, generate_both, prompts, tiny
from transformers import AutoModelForCausalLM

from hf_vkv import VKVCache

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


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("mode", ["greedy-padded", "beam", "sample"])
def test_cpu_and_disk_offload(tmp_path: Path, arch: str, mode: str) -> None:
    base, model = _offloaded(arch, tmp_path)
    inputs = prompts(2, 9, seed=41, left_pad=[0, 3])
    kwargs: dict[str, Any] = {
        "greedy-padded": {"do_sample": False},
        "beam": {"num_beams": 4, "num_return_sequences": 2, "do_sample": False},
        "sample": {"do_sample": True, "num_return_sequences": 2, "temperature": 1.5},
    }[mode]
    ref, got = generate_both(model, inputs, max_new_tokens=16, vkv={"page_bytes": SMALL_PAGE}, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    torch.manual_seed(0)
    plain = base.generate(**inputs, max_new_tokens=16, **kwargs)
    assert_same_tokens(plain, got.sequences)  # offloading changes nothing either
    cache = got.past_key_values
    assert isinstance(cache, VKVCache)
    assert all(layer.device == torch.device("cpu") for layer in cache.layers)
    cache.check_invariants()

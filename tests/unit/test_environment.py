"""``describe_environment``: the one source of the machine/library/command facts of every report."""

from __future__ import annotations

import os
import sys

import torch
import transformers

import hf_vkv
from hf_vkv.ab.harness import describe_environment


def test_without_a_model_it_describes_the_device_and_this_process() -> None:
    env = describe_environment(device="cpu")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())  # the schemas want strings
    assert env["device"].startswith("cpu: ") and "dtype" not in env
    assert (env["torch"], env["transformers"], env["hf_vkv"]) == (torch.__version__, transformers.__version__,
                                                                   hf_vkv.__version__)
    assert env["torch_threads"] == str(torch.get_num_threads()) and int(env["cpu_count"]) >= 1
    assert env["command"] == " ".join([os.path.basename(sys.executable), *sys.argv]) and {"platform", "kernel", "processor", "cpu_model"} <= set(env)
    assert "device_memory_bytes" not in env  # CUDA fields only for a CUDA device


def test_a_model_gives_device_and_dtype_and_the_command_can_be_given() -> None:
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    env = describe_environment(model, command="hf-vkv bench --quick")
    assert env["dtype"] == "bfloat16" and env["device"] == describe_environment(device="cpu")["device"]
    assert env["command"] == "hf-vkv bench --quick"

"""One rank of the tensor-parallel A/B (run by ``torchrun``; see ``test_tensor_parallel.py``).

Loads the model saved at ``argv[1]`` with ``tp_plan="auto"`` and prints, per generation mode, one
line ``RESULT <rank> <mode> <identical> <kv_heads_per_rank>`` comparing ``cache_implementation="vkv"``
(contiguous, and paged under ``"vkv_paged"``) with DynamicCache under the model's own attention.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM

import hf_vkv  # noqa: F401  (registers "vkv")

MODES = {"greedy": {}, "beams": {"num_beams": 4}}


def main(path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    rank = os.environ["RANK"]
    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True)
    own = model.config._attn_implementation
    for mode, extra in MODES.items():
        ref = model.generate(**common, **extra)
        for layout in ("contiguous", "paged"):
            model.set_attn_implementation("vkv_paged" if layout == "paged" else own)
            got = model.generate(**common, **extra, cache_implementation="vkv")  # the layout follows the attention
            model.set_attn_implementation(own)
            heads = got.past_key_values.layers[0].keys.shape[1]
            # the paged layout under "vkv_paged", else one of the CPU's contiguous ones (the rule's choice)
            placed = (got.past_key_values.layout == "paged") == (layout == "paged")
            same = torch.equal(ref.sequences, got.sequences) and placed
            print(f"RESULT {rank} {mode}-{got.past_key_values.layout} {same} {heads}", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    finally:
        # gloo's threads must stop before the interpreter exits: a process group left to static
        # destruction can abort a rank ("terminate called without an active exception")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

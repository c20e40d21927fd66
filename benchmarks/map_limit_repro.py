"""The mapping limit reproduced: a model with 32 layers x 64 K/V heads (head_dim 8), 64-token prompts,
head-major. Batch 2 fits (vkv's count of its mappings against /proc/self/maps); batch 8 reaches
vm.max_map_count: a typed refusal before anything changes, then the next generate runs.

    HF_HUB_OFFLINE=1 python benchmarks/map_limit_repro.py

It uses up to ~17k of this process's mappings (the limit is per process).
"""

from __future__ import annotations

import gc
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_vkv  # noqa: F401  (registers "vkv")
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, process_mappings


def _generate(model: LlamaForCausalLM, ids: torch.Tensor, new: int, **kwargs: object) -> object:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          pad_token_id=0, **kwargs)


def main() -> None:
    torch.set_num_threads(1)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=256, num_hidden_layers=32, num_attention_heads=64,
                      num_key_value_heads=64, head_dim=8, vocab_size=300, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for batch in (2, 8):
        ids = torch.randint(5, 300, (batch, 64))
        start = time.time()
        try:
            out = _generate(model, ids, 4, cache_implementation="vkv", return_dict_in_generate=True)
            print(f"batch {batch}: ok; vkv counts {PROCESS_MAP_BUDGET.held:,} mappings, process has "
                  f"{process_mappings():,}", flush=True)
            print("  same tokens as DynamicCache:", torch.equal(_generate(model, ids, 4), out.sequences))
            del out
        except Exception as e:  # the refusal is what this shows
            print(f"batch {batch}: {type(e).__name__}: {e}")
        gc.collect()
        print(f"  after: vkv {PROCESS_MAP_BUDGET.held:,}, process {process_mappings():,}, "
              f"{time.time() - start:.1f}s", flush=True)
    out = _generate(model, torch.randint(5, 300, (2, 64)), 2, cache_implementation="vkv")
    print("next generate after the refusal: ok", tuple(out.shape))


if __name__ == "__main__":
    main()

"""Issue 22 reproduction: a model with 32 layers x 64 K/V heads (head_dim 8), 64-token prompts, head-major;
batch 2 fits (vkv count vs /proc/self/maps), batch 8 reaches vm.max_map_count: typed refusal, then generate goes on.
Run: HF_HUB_OFFLINE=1 python benchmarks/map_limit_repro.py (uses up to ~17k of this process's mappings; per-process limit)."""
import os, sys, gc, time
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
import hf_vkv
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET, process_mappings
cfg = LlamaConfig(hidden_size=512, intermediate_size=256, num_hidden_layers=32, num_attention_heads=64,
                  num_key_value_heads=64, head_dim=8, vocab_size=300, max_position_embeddings=256)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
for batch in (2, 8):
    ids = torch.randint(5, 300, (batch, 64))
    t = time.time()
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             cache_implementation="vkv", return_dict_in_generate=True, pad_token_id=0)
        print(f"batch {batch}: ok; vkv counts {PROCESS_MAP_BUDGET.held:,} mappings, process has {process_mappings():,}", flush=True)
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
        print("  same tokens as DynamicCache:", torch.equal(ref, out.sequences))
        del out
    except Exception as e:
        print(f"batch {batch}: {type(e).__name__}: {e}")
    gc.collect()
    print(f"  after: vkv {PROCESS_MAP_BUDGET.held:,}, process {process_mappings():,}, {time.time()-t:.1f}s", flush=True)
ids = torch.randint(5, 300, (2, 64))
out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, cache_implementation="vkv", pad_token_id=0)
print("next generate after the refusal: ok", tuple(out.shape))

"""A short ``generate()`` on CUDA pages, run by ``test_gpu_sanitizer.py`` under compute-sanitizer.

Greedy and beam search (reorder + copy-on-write) with the tiny llama in float16, a llama whose
rows cross a 2 MiB page (beam reorder and copy-on-write across the boundary), and a readable
reservation read whole (the scratch page of the static layout); prints what ran so a broken run
is visible in the log. Kept short: memcheck slows every kernel down by one to two orders.
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ for models.py

import torch  # noqa: E402
from models import prompts, tiny  # noqa: E402

model = copy.deepcopy(tiny("llama")).to("cuda", torch.float16)
inputs = {k: v.to("cuda") for k, v in prompts(2, 9, seed=1, left_pad=[0, 3]).items()}
greedy = model.generate(**inputs, max_new_tokens=12, do_sample=False, cache_implementation="vkv")
beams = model.generate(**inputs, max_new_tokens=12, num_beams=3, do_sample=False, cache_implementation="vkv")
torch.cuda.synchronize()
print("greedy", greedy.tolist())
print("beams", beams.tolist())

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2)
torch.manual_seed(0)
wide = LlamaForCausalLM(cfg).to("cuda", torch.float16)  # 8 KiB of K/V a token: 256 tokens a page
long = {k: v.to("cuda") for k, v in prompts(2, 250, seed=2).items()}
crossing = wide.generate(**long, max_new_tokens=16, num_beams=2, do_sample=False, cache_implementation="vkv")
torch.cuda.synchronize()
print("crossing", crossing.shape[1])

from hf_vkv.cuda import CudaBackend  # noqa: E402
from hf_vkv.memory import PageId  # noqa: E402

b = CudaBackend(torch.device("cuda", 0), create_ahead=1, max_pages=4)
b.ensure_id_space(1)
b.create([PageId(0)])
base = b.reserve(3 * b.page_bytes, readable=True)
b.map(base + b.page_bytes, [PageId(0)])
view = b.tensor(base, 3 * b.page_bytes, None)
print("scratch", int(view.sum(dtype=torch.int64)) >= 0)
del view
torch.cuda.synchronize()
b.unmap(base, 3)
b.unreserve(base, 3 * b.page_bytes)
b.close()

"""A short ``generate()`` on CUDA pages, run by ``test_gpu_sanitizer.py`` under compute-sanitizer.

Greedy and beam search (reorder + copy-on-write) with the tiny llama in float16; prints the
tokens so a broken run is visible in the log.
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

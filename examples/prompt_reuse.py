"""Prompt reuse: prefill a system prompt once, then fork the cache per request (zero copy).

This is transformers' documented recipe (``copy.deepcopy`` of a prefilled cache); with vkv the
deep copy shares every page and copies only a page that a request writes into.
"""

import copy

import torch

import hf_vkv
from hf_vkv.default_model import load_default_model

model, tok = load_default_model()
system = "You are a terse assistant. Answer in one sentence.\n"
prefix = tok(system, return_tensors="pt")
cache = hf_vkv.VKVCache(config=model.config)
with torch.inference_mode():
    model(**prefix, cache=cache)  # prefill the shared prefix once (transformers < 5.24: past_key_values=cache)

for question in ["What is a page table?", "What is copy-on-write?"]:
    inputs = tok(system + question + "\n", return_tensors="pt")
    request_cache = copy.deepcopy(cache)  # a zero-copy fork
    out = model.generate(**inputs, cache=request_cache, max_new_tokens=25)
    print(repr(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)))
    print(f"  pages shared with the prefix: {request_cache.stats().shared_pages}")

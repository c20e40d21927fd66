"""Prompt reuse: prefill a system prompt once, then fork the cache per request (zero copy).

This is transformers' documented recipe (``copy.deepcopy`` of a prefilled cache); with vkv the
deep copy shares every page, and a request copies only the pages it writes into: the prompt's
last, partly filled page (a page holds 16 tokens of one (layer, K/V, head) here), never the full
pages before it.
"""

import copy

import torch

import hf_vkv
from hf_vkv.default_model import load_default_model

model, tok = load_default_model()
system = ("You are a terse assistant for the staff of a small food cooperative. Answer in one sentence, "
          "name the shelf or the form when the question is about stock or paperwork, and say you do not know "
          "when the answer is not in what you were told.\n")
prefix = tok(system, return_tensors="pt")
cache = hf_vkv.VKVCache(config=model.config)
with torch.inference_mode():
    model(**prefix, cache=cache)  # prefill the shared prefix once (transformers < 5.24: past_key_values=cache)
prefix_pages = set(cache.held_pages())

for question in ["What is a page table?", "What is copy-on-write?"]:
    inputs = tok(system + question + "\n", return_tensors="pt")
    request_cache = copy.deepcopy(cache)  # a zero-copy fork
    out = model.generate(**inputs, cache=request_cache, max_new_tokens=25)
    print(repr(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)))
    shared = len(prefix_pages & set(request_cache.held_pages()))
    print(f"  the prefix's {len(prefix_pages)} pages: {shared} still shared with the request, "
          f"{len(prefix_pages) - shared} copied (the partly filled last page of each sub-row)")

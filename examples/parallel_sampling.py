"""Parallel sampling: eight continuations of one prompt store the prompt once."""

import torch

import hf_vkv  # noqa: F401
from hf_vkv.default_model import load_default_model

model, tok = load_default_model()
inputs = tok("Once upon a time, in a city built on virtual memory,", return_tensors="pt")
torch.manual_seed(0)
out = model.generate(**inputs, do_sample=True, num_return_sequences=8, max_new_tokens=20,
                     cache_implementation="vkv", return_dict_in_generate=True)
for seq in out.sequences:
    print(repr(tok.decode(seq[inputs["input_ids"].shape[1]:], skip_special_tokens=True)))
stats = out.cache.stats()  # the cache generate built (transformers < 5.24: out.past_key_values)
print(f"rows sharing the prompt: {sum(g.shared_prompt_rows for g in stats.groups)}, "
      f"resident KV {stats.resident_bytes / 2**20:.2f} MiB")

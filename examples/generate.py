"""Greedy generation with the vkv cache on the embedded SmolLM2, and its memory accounting."""

import hf_vkv  # registers cache_implementation="vkv"
from hf_vkv.default_model import load_default_model

model, tok = load_default_model()
messages = [{"role": "user", "content": "Name three uses of virtual memory."}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

out = model.generate(**inputs, max_new_tokens=40, cache_implementation="vkv", return_dict_in_generate=True)
print(tok.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
stats = out.cache.stats()  # the cache generate built (transformers < 5.24: out.past_key_values)
print(f"resident KV {stats.resident_bytes / 2**20:.2f} MiB, utilization {stats.utilization:.0%}")

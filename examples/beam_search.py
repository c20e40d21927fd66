"""Beam search: beams share the prompt's pages and reorder by moving page references.

Only the partly written last page of a beam is copied when two beams continue from it.
"""

import hf_vkv  # noqa: F401
from hf_vkv.default_model import load_default_model

model, tok = load_default_model()
inputs = tok("A short poem about the sea:", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=30, num_beams=4, num_return_sequences=2,
                     cache_implementation="vkv", return_dict_in_generate=True)
for seq in out.sequences:
    print(repr(tok.decode(seq, skip_special_tokens=True)))
stats = out.cache.stats()  # the cache generate built (transformers < 5.24: out.past_key_values)
print(f"resident KV {stats.resident_bytes / 2**20:.2f} MiB, pages copied on write: {stats.cow_copies}")

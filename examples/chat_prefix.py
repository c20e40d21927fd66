"""A five-turn chat that reuses every earlier turn: each prompt's shared prefix comes from a
``PrefixStore`` (a zero-copy fork of the previous turn's pages), only the new text is prefilled.

Runs offline on the embedded SmolLM2-135M-Instruct.
"""

import torch

import hf_vkv
from hf_vkv.default_model import load_default_model

torch.set_num_threads(1)
model, tok = load_default_model()
store = hf_vkv.PrefixStore(model.config)
chat = [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."}]
questions = ["What is a page table?", "Why share pages?", "What is copy-on-write?", "When is a page freed?",
             "Summarize our chat."]

for turn, question in enumerate(questions, 1):
    chat.append({"role": "user", "content": question})
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    cache = store.lookup(ids)  # the longest stored prefix, or an empty cache
    reused = cache.get_seq_length()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=30,
                         do_sample=False, return_dict_in_generate=True)
    cached = out.cache.get_seq_length()  # transformers < 5.24 calls it past_key_values (here and above)
    store.insert(out.sequences[0, :cached], out.cache)  # the store keeps a fork
    answer = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    chat.append({"role": "assistant", "content": answer})
    print(f"turn {turn}: prompt {ids.shape[1]} tokens, reused {reused}, prefilled {ids.shape[1] - reused}")
    print(f"  {answer!r}")

stats = store.stats()
print(f"hits {stats.hits}/{stats.lookups}, tokens reused {stats.tokens_reused}, "
      f"entries {stats.entries}, bytes held {stats.bytes_held:,}")

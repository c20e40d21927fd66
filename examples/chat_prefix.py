"""A five-turn chat with one option: ``cache_config={"prefix_store": store}``. Each turn sends the
whole conversation; generate() starts from the longest stored prefix (the earlier turns, their
pages shared, not copied), prefills only the new tokens, and stores the finished turn.
Each turn prints the tokens reused and the time to first token beside DynamicCache's re-prefill.

Runs offline on the embedded SmolLM2-135M-Instruct.
"""

import time

import torch

import hf_vkv
from hf_vkv.ab.chat import FirstTokenClock
from hf_vkv.ab.demo_text import DOCUMENT
from hf_vkv.default_model import load_default_model

torch.set_num_threads(1)
model, tok = load_default_model()
store = hf_vkv.PrefixStore(model.config, budget_bytes=512 << 20)
reuse = {"cache_implementation": "vkv", "cache_config": {"prefix_store": store}}
chat = [{"role": "system", "content": DOCUMENT}]  # a ~1k-token handbook
questions = ["What is Harbor Light?", "Who may shop on Saturdays?", "What is the margin for?",
             "How do I join?", "Summarize our chat."]


def first_token(ids, **kwargs):
    clock, start = FirstTokenClock(), time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                         streamer=clock, **kwargs)
    return clock.first_token_at - start, out


for turn, question in enumerate(questions, 1):
    chat.append({"role": "user", "content": question})
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ttft, result = first_token(ids, return_dict_in_generate=True, **reuse)  # prefills only what is new
    report, out = hf_vkv.reuse_report(result), result.sequences  # what this call reused
    ttft_dynamic, want = first_token(ids)  # DynamicCache: the whole conversation again
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    chat.append({"role": "assistant", "content": answer})
    print(f"turn {turn}: prompt {ids.shape[1]} tokens, reused {report.reused_tokens}, "
          f"first token {ttft:.2f} s (DynamicCache {ttft_dynamic:.2f} s), same tokens: {torch.equal(out, want)}")
    print(f"  {answer!r}")

stats = store.stats()
print(f"hits {stats.hits}/{stats.lookups}, tokens reused {stats.tokens_reused:,}, entries {stats.entries}, "
      f"bytes held {stats.bytes_held:,}, prompt tokens computed {stats.prompt_tokens_computed:,} "
      f"of {stats.prompt_tokens:,}")

"""Eight different questions about one document, in one batch, with a prefix store: the document
is prefilled once (the questions share it), each row then prefills only its question. The store
keeps the rows, so asking again, or in a pipeline() with chat messages, starts from them.

Runs offline on the embedded SmolLM2-135M-Instruct.
"""

import time

import torch
from transformers import pipeline

import hf_vkv
from hf_vkv.ab.demo_text import DOCUMENT
from hf_vkv.default_model import load_default_model

torch.set_num_threads(1)
model, tok = load_default_model()
store = hf_vkv.PrefixStore(model.config, budget_bytes=1 << 30)
questions = ["Who owns the store?", "What is the margin?", "Where did it open?", "How many households?",
             "Who may shop on Saturdays?", "What pays for the van?", "Who decides on the surplus?", "How to join?"]
texts = [tok.apply_chat_template([{"role": "user", "content": f"{DOCUMENT}\n\n{q}"}], add_generation_prompt=True,
                                 tokenize=False) for q in questions]
tok.padding_side = "left"
batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

start = time.perf_counter()
result = model.generate(**batch, max_new_tokens=20, do_sample=False, cache_implementation="vkv",
                        cache_config={"prefix_store": store}, return_dict_in_generate=True)
report, out = hf_vkv.reuse_report(result), result.sequences  # what this call reused
print(f"{len(questions)} questions in {time.perf_counter() - start:.1f} s: the shared document "
      f"({report.common_prefix_tokens} tokens) prefilled once, {report.computed_tokens:,} prompt tokens computed "
      f"of {report.prompt_tokens:,}; {report.copied_rows} left-padded rows copied their prefix")
for q, row in zip(questions, out):
    print(f"  {q} -> {tok.decode(row[batch['input_ids'].shape[1]:], skip_special_tokens=True)!r}")

# the same store through a pipeline with chat messages: the document comes from the store
pipe = pipeline("text-generation", model=model, tokenizer=tok)
messages = [{"role": "user", "content": f"{DOCUMENT}\n\n{questions[0]}"}]
lent = store.stats().tokens_reused  # a pipeline returns text: the store counts the tokens it lent
reply = pipe(messages, max_new_tokens=20, do_sample=False, cache_implementation="vkv",
             cache_config={"prefix_store": store})
print(f"pipeline: reused {store.stats().tokens_reused - lent} tokens -> {reply[0]['generated_text'][-1]['content']!r}")

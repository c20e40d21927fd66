"""A batched text-generation pipeline with the vkv cache (prompts are left-padded)."""

from transformers import pipeline

import hf_vkv  # noqa: F401  (registers "vkv")
from hf_vkv.default_model import load_default_model

model, tok = load_default_model()
pipe = pipeline("text-generation", model=model, tokenizer=tok)
prompts = ["The capital of France is", "Three primary colors are"]
for result in pipe(prompts, batch_size=2, max_new_tokens=20, do_sample=False, cache_implementation="vkv"):
    print(result[0]["generated_text"])

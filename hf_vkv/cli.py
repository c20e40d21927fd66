"""The ``hf-vkv`` command: ``hf-vkv demo`` runs the embedded model with the vkv cache and compares
it with DynamicCache."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

DEMO_PROMPT = "Explain in two sentences why a key-value cache makes text generation faster."


def _kv_bytes(cache: Any) -> int:
    """Physical KV bytes: VKV's resident pages, or the tensors of a transformers cache."""
    from .cache import VKVCache

    if isinstance(cache, VKVCache):
        return cache.stats().resident_bytes
    return sum(
        t.numel() * t.element_size()
        for layer in getattr(cache, "layers", [])
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if t is not None and hasattr(t, "numel")
    )


def _run(model: Any, inputs: dict, *, cache: str, **kwargs: Any) -> tuple[Any, float, int]:
    import torch

    extra = {"cache_implementation": "vkv"} if cache == "vkv" else {}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, return_dict_in_generate=True, **extra, **kwargs)
    return out.sequences, time.perf_counter() - t0, _kv_bytes(out.past_key_values)


def demo(args: argparse.Namespace) -> int:
    """Generate on the embedded SmolLM2 with vkv, print the text and an A/B table."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from .default_model import load_default_model

    print("loading the embedded SmolLM2-135M-Instruct (converted once to safetensors, then cached)...", flush=True)
    model, tok = load_default_model(dtype=torch.float32)
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                   add_generation_prompt=True)
    inputs = dict(tok(text, return_tensors="pt"))
    prompt_len = inputs["input_ids"].shape[1]
    common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)

    seq, _, _ = _run(model, inputs, cache="vkv", **common)
    print("\n" + tok.decode(seq[0, prompt_len:], skip_special_tokens=True).strip() + "\n")

    rows = []
    for name, kwargs in (("greedy", {}), ("beam search, 4 beams", {"num_beams": 4}),
                         ("sampling, n=8", {"do_sample": True, "num_return_sequences": 8})):
        ref, t_ref, kv_ref = _run(model, inputs, cache="dynamic", **common, **kwargs)
        got, t_got, kv_got = _run(model, inputs, cache="vkv", **common, **kwargs)
        rows.append((name, torch.equal(ref, got), kv_ref, kv_got, t_ref, t_got))

    print(f"A/B against DynamicCache (prompt {prompt_len} tokens, {args.max_new_tokens} new tokens, CPU fp32):")
    header = f"{'mode':22s} {'tokens':>10s} {'KV dynamic':>11s} {'KV vkv':>9s} {'ratio':>6s} {'time dyn':>9s} {'time vkv':>9s}"
    print(header)
    print("-" * len(header))
    for name, same, kv_ref, kv_got, t_ref, t_got in rows:
        print(f"{name:22s} {'identical' if same else 'DIFFERENT':>10s} {kv_ref / 2**20:9.2f}Mi {kv_got / 2**20:7.2f}Mi "
              f"{kv_got / kv_ref if kv_ref else float('nan'):6.2f} {t_ref:8.2f}s {t_got:8.2f}s")
    return 0 if all(r[1] for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-vkv`` console script."""
    parser = argparse.ArgumentParser(prog="hf-vkv", description="A virtual-memory KV cache for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate on the embedded SmolLM2 with vkv and A/B it against DynamicCache")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

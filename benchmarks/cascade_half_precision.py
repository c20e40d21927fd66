"""The ``"vkv_cascade"`` attention in half precision: token agreement and max |Δlogit| against
DynamicCache (sdpa) for n=8 sampling and 4 beams, in bfloat16 and float16 (and float32 beside),
over many seeds and prompts past the crossover.

The tiny Llama holds 256 positions, so the crossover (``hf_vkv.devices.CASCADE_MIN_SHARED_TOKENS``)
is lowered to 1 shared token for the measurement (the module attribute the cache reads at each step), and the cascade is asked for by name in half precision
(``cache_config={"cascade_half_precision": True}``; without it the cache does not tag prefixes in
half precision and sdpa runs). Writes ``benchmarks/results/cascade_half_precision.json``.

    python benchmarks/cascade_half_precision.py [--cases 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import hf_vkv  # noqa: F401  (registers "vkv" and "vkv_cascade")
import hf_vkv.attention.cascade as cascade_module
import hf_vkv.devices as devices
from common import write_report
from hf_vkv.ab.harness import describe_environment

VOCAB = 512


def model_in(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits, as trained models have
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return model.to(dtype)


def one_case(model, dtype: torch.dtype, mode: str, seed: int, *, new: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    length = 120 + seed % 5 * 25  # 120-220 shared tokens, past the lowered crossover
    ids = torch.randint(3, VOCAB, (1, length), generator=g)
    kwargs = dict(max_new_tokens=new, return_dict_in_generate=True, output_logits=True)
    kwargs |= dict(do_sample=True, num_return_sequences=8) if mode == "n8_sampling" else dict(num_beams=4, do_sample=False)
    model.set_attn_implementation("sdpa")
    torch.manual_seed(seed)
    ref = model.generate(input_ids=ids, **kwargs)
    model.set_attn_implementation("vkv_cascade")
    real, calls = cascade_module.cascade_decode, []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    cascade_module.cascade_decode = counted
    try:
        torch.manual_seed(seed)
        got = model.generate(input_ids=ids, cache_implementation="vkv",
                             cache_config={"cascade_half_precision": True}, **kwargs)
    finally:
        model.set_attn_implementation("sdpa")
        cascade_module.cascade_decode = real
    same_tokens = ref.sequences.shape == got.sequences.shape and torch.equal(ref.sequences, got.sequences)
    steps = min(len(ref.logits), len(got.logits))
    prompt = ids.shape[1]
    # the first step whose generated tokens differ; logits are compared up to it (after it the rows differ)
    first_bad = next((s for s in range(steps) if not torch.equal(ref.sequences[:, prompt + s], got.sequences[:, prompt + s])),
                     None) if ref.sequences.shape == got.sequences.shape else 0
    upto = steps if first_bad is None else first_bad + 1
    diff = max((ref.logits[s].float() - got.logits[s].float()).abs().max().item() for s in range(upto))
    return {"mode": mode, "dtype": str(dtype).removeprefix("torch."), "seed": seed, "prompt_tokens": length,
            "tokens_identical": bool(same_tokens), "max_abs_logit_diff": diff,
            "first_step_tokens_differ": first_bad, "cascade": got.past_key_values.stats().cascade,
            "cascade_decodes": len(calls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20, help="seeds (and prompts) per mode and dtype")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new", type=int, default=16, help="new tokens per generate")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cascade_half_precision.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices.CASCADE_MIN_SHARED_TOKENS = {1: {2: 1}}  # tiny prompts: every shared prefix counts
    cases, summary = [], []
    start = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = model_in(dtype)
        for mode in ("n8_sampling", "beams4"):
            rows = [one_case(model, dtype, mode, seed, new=args.new) for seed in range(args.cases)]
            cases += rows
            summary.append({"dtype": rows[0]["dtype"], "mode": mode, "cases": len(rows),
                            "tokens_identical": sum(r["tokens_identical"] for r in rows),
                            "cases_with_cascade_decodes": sum(r["cascade_decodes"] > 0 for r in rows),
                            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows)})
            print(summary[-1], flush=True)
    write_report(args.out, {
        "benchmark": "cascade_half_precision",
        "environment": describe_environment(command="python " + " ".join([sys.argv[0], *(argv if argv is not None
                                                                                           else sys.argv[1:])])),
        "threads": args.threads,
        "crossover_lowered_to": 1, "new_tokens": args.new, "seconds": time.perf_counter() - start,
        "summary": summary, "cases": cases,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where reading a shared prefix once pays: one layer's decode attention, sdpa over every row's
keys against :func:`hf_vkv.attention.cascade.cascade_decode`, over shared-prefix length x rows.

SmolLM2-135M's attention geometry by default (9 query heads, 3 key/value heads, head dim 64),
float32, one query per row, each row's keys at their own addresses (as a cache hands them: the
shared prefix is the same bytes, but sdpa reads it once per row), a suffix of ``--suffix`` tokens
per row. Median of ``--repeats`` timings per cell, the two paths interleaved, one thread.

    python benchmarks/cascade_crossover.py --json benchmarks/results/cascade_crossover.json

More subcommands, each with its own ``--help``:

* ``beams``: 4 beams' whole decode steps on SmolLM2, vkv with sdpa against vkv with
  ``"vkv_cascade"`` forced on every shared prefix (``results/cascade_beams_cpu.json``);
* ``half-precision``: the cascade's token agreement and max |Δlogit| in bfloat16 and float16 on a
  tiny Llama (``results/cascade_half_precision.json``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList, GenerationConfig, LlamaConfig, LlamaForCausalLM

import hf_vkv  # noqa: F401  (registers "vkv" and "vkv_cascade")
import hf_vkv.attention.cascade as cascade_module
import hf_vkv.devices as devices
from hf_vkv.ab.harness import describe_environment
from hf_vkv.attention.cascade import cascade_decode
from hf_vkv.default_model import load_default_model
from hf_vkv.kv_records import Cluster, SharedPrefix
from common import StepMarks, dispatch, write_report


def _time(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def cell(prefix: int, rows: int, *, suffix: int, heads: int, kv_heads: int, dim: int, repeats: int) -> dict[str, Any]:
    """One (prefix, rows) cell: median seconds of sdpa and of the cascade, and their max |diff|."""
    g = torch.Generator().manual_seed(prefix * 100 + rows)
    total = prefix + suffix
    shared_k = torch.randn(kv_heads, prefix, dim, generator=g)
    shared_v = torch.randn(kv_heads, prefix, dim, generator=g)
    key = torch.randn(rows, kv_heads, total, dim, generator=g)
    value = torch.randn(rows, kv_heads, total, dim, generator=g)
    key[:, :, :prefix] = shared_k
    value[:, :, :prefix] = shared_v
    query = torch.randn(rows, heads, 1, dim, generator=g)
    record = SharedPrefix(clusters=(Cluster(index=tuple(range(rows)), tokens=prefix),), alone=())
    scale = dim ** -0.5

    def plain() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True)

    def cascade() -> torch.Tensor:
        return cascade_decode(query, key, value, mask=None, scale=scale, prefix=record)

    sdpa_s, cascade_s = [], []
    for _ in range(repeats):  # interleaved
        sdpa_s += _time(plain, 1)
        cascade_s += _time(cascade, 1)
    a, b = statistics.median(sdpa_s), statistics.median(cascade_s)
    return {"prefix": prefix, "rows": rows, "suffix": suffix, "sdpa_ms": a * 1e3, "cascade_ms": b * 1e3,
            "cascade_over_sdpa": b / a, "max_abs_diff": (plain() - cascade()).abs().max().item()}


def default_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cells = []
    for prefix in args.prefixes:
        for rows in args.rows:
            c = cell(prefix, rows, suffix=args.suffix, heads=args.heads, kv_heads=args.kv_heads, dim=args.dim,
                     repeats=args.repeats)
            cells.append(c)
            print(f"prefix {prefix:5d} rows {rows}: sdpa {c['sdpa_ms']:7.3f} ms  cascade {c['cascade_ms']:7.3f} ms  "
                  f"ratio {c['cascade_over_sdpa']:.2f}  max|diff| {c['max_abs_diff']:.1e}", flush=True)
    if args.json:
        report = {"benchmark": "cascade_crossover", "threads": args.threads,
                  "environment": describe_environment(command="python " + " ".join(sys.argv)), "cells": cells}
        write_report(__import__("pathlib").Path(args.json), report)


# ---------------------------------------- beams (formerly benchmarks/cascade_beams.py)
BEAMS_DOC = """Where reading the beams' common history once pays: 4-beam decode steps of vkv with sdpa against
vkv with ``"vkv_cascade"`` forced on every shared prefix, over prompt lengths.

``benchmarks/cascade_crossover.py`` times one layer's attention on synthetic keys; this times the
whole beam-search step on the embedded SmolLM2-135M (fp32), where the beams' shared prefix is
whatever the page tables say after each reorder (the prompt and the full pages of history the
beams still have in common). The cascade is forced (``CASCADE_MIN_SHARED_TOKENS`` set to 1 for
the run) so it runs even below the crossover it sets. Decode step = median time between two
logits-processor calls of a run; per cell the median over ``--rounds`` rounds, the two attentions
interleaved (rotated by round), at each of ``--threads``; tokens compared between the two.

    python benchmarks/cascade_crossover.py beams --prompts 256 512 1024 2048 --threads 1 2 \\
        --json benchmarks/results/cascade_beams_cpu.json
"""


def run(model: Any, ids: torch.Tensor, attention: str, new: int) -> tuple[float, torch.Tensor]:
    """One 4-beam generate(): the median decode step (seconds) and the sequences."""
    model.set_attn_implementation(attention)
    gc.collect()
    marks = StepMarks()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="vkv", num_beams=4,
                         do_sample=False, max_new_tokens=new, min_new_tokens=new,
                         logits_processor=LogitsProcessorList([marks]), return_dict_in_generate=True)
    return marks.median_step(), out.sequences


def _shared_tokens_seen() -> tuple[list[int], Any]:
    """A list filled with the shared-prefix lengths the cascade reads, and the function that
    restores :func:`hf_vkv.attention.cascade.cascade_decode`."""
    seen: list[int] = []
    real = cascade_module.cascade_decode

    def recording(*args: Any, prefix: Any, **kwargs: Any) -> torch.Tensor:
        seen.extend(c.tokens for c in prefix.clusters)
        return real(*args, prefix=prefix, **kwargs)

    cascade_module.cascade_decode = recording
    return seen, lambda: setattr(cascade_module, "cascade_decode", real)


def main_beams(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="cascade_crossover.py beams", description=BEAMS_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--new", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = load_default_model()[0]
    rows = []
    saved = devices.CASCADE_MIN_SHARED_TOKENS
    devices.CASCADE_MIN_SHARED_TOKENS = {1: {2: 1}}  # every shared prefix read once: the measurement below the crossover too
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for prompt in args.prompts:
                ids = torch.randint(100, 40000, (1, prompt), generator=torch.Generator().manual_seed(prompt))
                steps: dict[str, list[float]] = {"sdpa": [], "vkv_cascade": []}
                seqs: dict[str, torch.Tensor] = {}
                seen, restore = _shared_tokens_seen()
                try:
                    for r in range(args.rounds):
                        for attention in (("sdpa", "vkv_cascade") if r % 2 == 0 else ("vkv_cascade", "sdpa")):
                            step, seqs[attention] = run(model, ids, attention, args.new)
                            steps[attention].append(step)
                finally:
                    restore()
                plain, cascade = (statistics.median(steps[a]) * 1e3 for a in ("sdpa", "vkv_cascade"))
                row = {"threads": threads, "prompt": prompt, "beams": 4,
                       "shared_tokens_read_once": sorted(set(seen)),  # the clusters' prefixes (full shared pages)
                       "sdpa_step_ms": plain, "cascade_step_ms": cascade, "cascade_over_sdpa": cascade / plain,
                       "rounds_ms": {a: [round(s * 1e3, 2) for s in v] for a, v in steps.items()},
                       "tokens_identical": bool(torch.equal(seqs["sdpa"], seqs["vkv_cascade"]))}
                rows.append(row)
                print(row, flush=True)
    finally:
        devices.CASCADE_MIN_SHARED_TOKENS = saved
    if args.json:
        write_report(Path(args.json), {
            "benchmark": "cascade_beams", "new_tokens": args.new, "rounds": args.rounds, "rows": rows,
            "method": "4-beam generate() of vkv, attention sdpa vs vkv_cascade (forced on every shared prefix: "
            "CASCADE_MIN_SHARED_TOKENS={1: {2: 1}}), decode step = median gap between logits-processor calls, median over "
            "rounds, interleaved",
            "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


# ---------------------------------------- half-precision (formerly benchmarks/cascade_half_precision.py)
HALF_PRECISION_DOC = """The ``"vkv_cascade"`` attention in half precision: token agreement and max |Δlogit| against
DynamicCache (sdpa) for n=8 sampling and 4 beams, in bfloat16 and float16 (and float32 beside),
over many seeds and prompts past the crossover.

The tiny Llama holds 256 positions, so the crossover (``hf_vkv.devices.CASCADE_MIN_SHARED_TOKENS``)
is lowered to 1 shared token for the measurement (the module attribute the cache reads at each step), and the cascade is asked for by name in half precision
(``cache_config={"cascade_half_precision": True}``; without it the cache does not tag prefixes in
half precision and sdpa runs). Writes ``benchmarks/results/cascade_half_precision.json``.

    python benchmarks/cascade_crossover.py half-precision [--cases 20] [--threads 1]
"""


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


def main_half_precision(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cascade_crossover.py half-precision", description=HALF_PRECISION_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
        "environment": describe_environment(command="python " + " ".join([sys.argv[0], "half-precision", *argv])),
        "threads": args.threads,
        "crossover_lowered_to": 1, "new_tokens": args.new, "seconds": time.perf_counter() - start,
        "summary": summary, "cases": cases,
    })
    return 0


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"beams": main_beams, "half-precision": main_half_precision})


if __name__ == "__main__":
    raise SystemExit(main())

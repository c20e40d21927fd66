"""Short-prompt beam search by layout: DynamicCache, vkv head-major, vkv token-major.

``generate(num_beams=B)`` on the embedded SmolLM2-135M (fp32, CPU, ``--threads`` intra-op threads)
from the demo's short prompt (45 tokens with the chat template, or ``--prompt-tokens`` random ids),
the caches interleaved in rotated order over ``--rounds`` rounds; per cache the median decode step
(between two logits-processor calls) and wall time, the
KV bytes it holds when generate returns (``hf_vkv.ab.probes.kv_bytes``: vkv's resident pages, a
shared page once) and whether its tokens equal DynamicCache's. Writes JSON with the device,
versions and the exact command.

    python benchmarks/beam_layout_cpu.py --rounds 4 --json benchmarks/results/beam_layout_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import hf_vkv  # noqa: F401  (registers "vkv")
from common import StepMarks, write_report  # benchmarks/common.py
from hf_vkv.ab.demo import encode_prompt
from hf_vkv.ab.demo_text import SHORT_PROMPT
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.default_model import load_default_model
from hf_vkv.registration import cache_kwarg

CACHES = {"dynamic": {}, "head_major": {"layout": "head_major"}, "token_major": {"layout": "token_major"}}


def run(model: torch.nn.Module, inputs: dict, name: str, *, beams: int, new_tokens: int
        ) -> tuple[float, float, int, torch.Tensor]:
    """One generate(): seconds, median decode step seconds, KV bytes held at the end, the sequences."""
    extra = {} if name == "dynamic" else {"cache_implementation": "vkv", "cache_config": CACHES[name]}
    marks = StepMarks()
    start = time.perf_counter()
    out = model.generate(**inputs, num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([marks]), **extra)
    wall = time.perf_counter() - start
    return wall, marks.median_step(), kv_bytes(out[cache_kwarg()]), out.sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="random ids instead of the demo's prompt")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model(dtype=torch.float32)
    if args.prompt_tokens:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, model.config.vocab_size, (1, args.prompt_tokens), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        inputs = encode_prompt(tok, SHORT_PROMPT)
    prompt = inputs["input_ids"].shape[1]
    names = list(CACHES)
    with torch.inference_mode():
        run(model, inputs, "dynamic", beams=args.beams, new_tokens=2)  # warm-up, untimed
        walls: dict[str, list[float]] = {n: [] for n in names}
        steps: dict[str, list[float]] = {n: [] for n in names}
        kv: dict[str, int] = {}
        seqs: dict[str, torch.Tensor] = {}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                wall, step, held, seq = run(model, inputs, name, beams=args.beams, new_tokens=args.new_tokens)
                walls[name].append(wall)
                steps[name].append(step)
                kv[name], seqs[name] = held, seq
    ref = walls["dynamic"]
    results = {}
    print(f"prompt {prompt} tokens, {args.beams} beams, {args.new_tokens} new tokens, {args.threads} threads, "
          f"{args.rounds} rounds")
    for name in names:
        ratios = [w / d for w, d in zip(walls[name], ref)]
        step_ratios = [a / d for a, d in zip(steps[name], steps["dynamic"])]
        results[name] = {"wall_s": walls[name], "median_wall_s": statistics.median(walls[name]),
                         "step_ms": [s * 1e3 for s in steps[name]], "median_step_ms": statistics.median(steps[name]) * 1e3,
                         "median_step_ratio_to_dynamic": statistics.median(step_ratios),
                         "median_ratio_to_dynamic": statistics.median(ratios), "kv_bytes": kv[name],
                         "kv_ratio_to_dynamic": kv[name] / kv["dynamic"],
                         "tokens_equal_dynamic": bool(torch.equal(seqs[name], seqs["dynamic"]))}
        print(f"{name:12s} step {statistics.median(steps[name]) * 1e3:.1f} ms (x{statistics.median(step_ratios):.3f}) "
              f"wall {statistics.median(walls[name]):.2f} s (x{statistics.median(ratios):.3f}; rounds "
              f"{' '.join(f'{w:.2f}' for w in walls[name])}), KV {kv[name] / 2**20:.2f} MiB "
              f"(x{kv[name] / kv['dynamic']:.2f}), tokens {'equal' if results[name]['tokens_equal_dynamic'] else 'DIFFER'}")
    if args.json:
        write_report(args.json, {"prompt_tokens": prompt, "beams": args.beams, "new_tokens": args.new_tokens,
                                 "rounds": args.rounds, "threads": args.threads, "results": results,
                                 "method": "one generate() per cache per round (min_new_tokens = max_new_tokens), "
                                 "caches interleaved, rotated by round; decode step = median time between two "
                                 "logits-processor calls of a run, then the median over rounds",
                                 "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


if __name__ == "__main__":
    main()

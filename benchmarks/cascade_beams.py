"""Where reading the beams' common history once pays: 4-beam decode steps of vkv with sdpa against
vkv with ``"vkv_cascade"`` forced on every shared prefix, over prompt lengths.

``benchmarks/cascade_crossover.py`` times one layer's attention on synthetic keys; this times the
whole beam-search step on the embedded SmolLM2-135M (fp32), where the beams' shared prefix is
whatever the page tables say after each reorder (the prompt and the full pages of history the
beams still have in common). The cascade is forced (``CASCADE_MIN_SHARED_TOKENS`` set to 1 for
the run) so it runs even below the crossover it sets. Decode step = median time between two
logits-processor calls of a run; per cell the median over ``--rounds`` rounds, the two attentions
interleaved (rotated by round), at each of ``--threads``; tokens compared between the two.

    python benchmarks/cascade_beams.py --prompts 256 512 1024 2048 --threads 1 2 \\
        --json benchmarks/results/cascade_beams_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList

import hf_vkv  # noqa: F401  (registers "vkv" and "vkv_cascade")
from common import StepMarks, write_report
from hf_vkv import devices
import hf_vkv.attention.cascade as cascade_module
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--new", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()

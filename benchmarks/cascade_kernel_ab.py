"""The cascade attention's kernel against an earlier commit's, inside whole 4-beam decode steps.

Both kernels run in one process on the same model, prompt and cache kind: the earlier
``hf_vkv/attention/cascade.py`` is read from git (``--before``, a commit), loaded as a module, and
its ``cascade_decode`` swapped in for :func:`hf_vkv.attention.cascade.cascade_decode` (what
``vkv_cascade_attention`` calls) for its runs. Every run is a 4-beam ``generate`` of vkv with
``"vkv_cascade"`` on the embedded SmolLM2-135M (fp32); decode step = median gap between two
logits-processor calls; per kernel the median over ``--rounds`` rounds, the two interleaved
(rotated by round); tokens compared between the two. The table of where the cascade pays is the
current one for both (the earlier kernel reads the same shared prefixes).

    python benchmarks/cascade_kernel_ab.py --before 3b7466b --prompt 2048 --threads 1 --rounds 5 \\
        --json benchmarks/results/cascade_kernel_ab_2048_t1.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import torch

import hf_vkv  # noqa: F401  (registers "vkv" and "vkv_cascade")
import hf_vkv.attention.cascade as cascade_module
from cascade_beams import run
from common import write_report
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model

ROOT = Path(__file__).resolve().parents[1]


def kernel_at(commit: str) -> Any:
    """``cascade_decode`` of ``hf_vkv/attention/cascade.py`` as of ``commit`` (its relative
    imports resolved against today's package)."""
    source = subprocess.run(["git", "show", f"{commit}:hf_vkv/attention/cascade.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"cascade_at_{commit}")
    module.__package__ = "hf_vkv.attention"
    exec(compile(source, f"{commit}:hf_vkv/attention/cascade.py", "exec"), module.__dict__)
    return module.cascade_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit whose kernel is compared")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_default_model()[0]
    model.set_attn_implementation("vkv_cascade")
    ids = torch.randint(100, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(args.prompt))
    kernels = {"before": kernel_at(args.before), "after": cascade_module.cascade_decode}
    calls = {name: 0 for name in kernels}
    steps: dict[str, list[float]] = {name: [] for name in kernels}
    seqs: dict[str, torch.Tensor] = {}
    real = cascade_module.cascade_decode
    try:
        for r in range(args.rounds):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                kernel = kernels[name]

                def counted(*a: Any, __kernel: Any = kernel, __name: str = name, **k: Any) -> torch.Tensor:
                    calls[__name] += 1
                    return __kernel(*a, **k)

                cascade_module.cascade_decode = counted
                step, seqs[name] = run(model, ids, "vkv_cascade", args.new)
                steps[name].append(step)
                print(f"round {r} {name}: {step * 1e3:.1f} ms", flush=True)
    finally:
        cascade_module.cascade_decode = real
    before, after = (statistics.median(steps[n]) * 1e3 for n in ("before", "after"))
    report = {"benchmark": "cascade_kernel_ab", "before": args.before, "prompt": args.prompt, "beams": 4,
              "threads": args.threads, "new_tokens": args.new, "rounds": args.rounds,
              "before_step_ms": before, "after_step_ms": after, "after_over_before": after / before,
              "rounds_ms": {n: [round(s * 1e3, 2) for s in v] for n, v in steps.items()},
              "cascade_calls": calls, "tokens_identical": bool(torch.equal(seqs["before"], seqs["after"])),
              "method": "4-beam generate() of vkv with vkv_cascade, cascade_decode of --before (from git) vs the "
                        "working tree's, swapped in per run; decode step = median gap between logits-processor "
                        "calls, median over rounds, interleaved",
              "environment": describe_environment(model, command="python " + " ".join(sys.argv))}
    print(f"before {before:.1f} ms, after {after:.1f} ms ({after / before:.3f}x), calls {calls}, "
          f"tokens identical {report['tokens_identical']}")
    if args.json:
        write_report(Path(args.json), report)


if __name__ == "__main__":
    main()

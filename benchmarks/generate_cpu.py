"""Decode step and KV memory of the vkv layouts against DynamicCache and an ideal cache (CPU).

On the embedded SmolLM2-135M (fp32). A thin script over :mod:`hf_vkv.ab.bench` (the same code as
``hf-vkv bench``; only the default grid differs). Per cell (prompt length x batch): ms per decode
step of DynamicCache, the ideal cache (K/V preallocated at full capacity, narrow views, no copy)
and each vkv layout, each layout's ratio to the ideal cache and to DynamicCache, and each vkv
cache's ``stats().utilization``. The prompt is prefilled once per prompt length and loaded into
every cache through its own ``update()``; the decode steps of the caches run interleaved on one
intra-op thread, ``--rounds`` times, and the median round is reported; every cache must choose
DynamicCache's tokens at every step (exit status 1 otherwise).

The full grid (prompts 64/512/2048/8192, batches 1/4/8, 24 new tokens, 3 rounds; the 8192 x 8
cell holds four caches of ~3 GiB each at once, ~14 GiB of memory in all)::

    HF_HUB_OFFLINE=1 python benchmarks/generate_cpu.py --threads 2 \\
        --json benchmarks/results/generate_cpu_decode.json

A quick grid (prompts 64/512, batches 1/4, 16 new tokens)::

    python benchmarks/generate_cpu.py --quick --json /tmp/quick.json

``--modes beam4 sample8`` adds generate() A/B runs (DynamicCache against the default vkv cache;
KV memory of beam search and parallel sampling) at every cell with a batch <= 4.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from hf_vkv.ab.bench_args import add_arguments, grid_from_args, run_from_args
from hf_vkv.default_model import load_default_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, default="full")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/generate_cpu_decode.json"))
    args = parser.parse_args(argv)
    try:
        grid = grid_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, _ = load_default_model(dtype=torch.float32)
    command = " ".join(["python", "benchmarks/generate_cpu.py", *(sys.argv[1:] if argv is None else argv)])
    return run_from_args(args, model, grid=grid, model_name="SmolLM2-135M-Instruct (embedded, fp32)",
                         command=command, json_path=args.json)


if __name__ == "__main__":
    raise SystemExit(main())

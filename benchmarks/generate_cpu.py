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

from pathlib import Path

from hf_vkv.ab.bench_args import add_arguments, grid_from_args, run_from_args, script_main


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, doc=__doc__, script="benchmarks/generate_cpu.py",
                       add=lambda parser: add_arguments(parser, default="full"), make_grid=grid_from_args,
                       run=run_from_args, json_default=Path("benchmarks/results/generate_cpu_decode.json"))

if __name__ == "__main__":
    raise SystemExit(main())

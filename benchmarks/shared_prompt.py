"""Shared prompts in time: TTFT and decode step of generate() for n=8 sampling, 4 beams
and greedy, DynamicCache against vkv, vkv with the "vkv_cascade" attention, and an ideal (CPU).

On the embedded SmolLM2-135M (fp32). A thin script over :mod:`hf_vkv.ab.shared_prompt` (the same
code as ``hf-vkv bench --shared-prompt``): per prompt length x workload, one generate() per cache
per round (1 + decode steps new tokens), the caches interleaved in one process, the median of
``--rounds`` rounds; TTFT is the time from the generate() call to the first logits (set-up,
prefill, output head), a decode step the median time between two logits processor calls. The
ideal's TTFT is one row's prefill of the prompt (1/N of DynamicCache's rows); its decode is the
IdealCache (hf_vkv/ab/ideal.py) preloaded with that prefill. The vkv_cascade column runs where
"vkv_cascade" is registered with transformers' AttentionInterface, and is skipped with the
reason in the JSON otherwise. vkv's tokens and logits are compared with DynamicCache's (exit
status 1 when its tokens differ); vkv_cascade's max |dlogit| and token agreement are reported.

The grid (8192 x DynamicCache takes many minutes per run on one thread: skip it past
a limit with --dynamic-limit-s, the skip recorded)::

    HF_HUB_OFFLINE=1 python benchmarks/shared_prompt.py --prompts 512 2048 --rounds 3 \\
        --json benchmarks/results/shared_prompt_cpu.json

A quick check::

    python benchmarks/shared_prompt.py --prompts 128 --rounds 1 --workloads greedy --json /tmp/sp.json
"""

from __future__ import annotations

from pathlib import Path

from hf_vkv.ab.bench_args import add_shared_prompt_arguments, shared_grid_from_args, run_shared_from_args, script_main


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, doc=__doc__, script="benchmarks/shared_prompt.py",
                       add=lambda parser: add_shared_prompt_arguments(parser, standalone=True),
                       make_grid=shared_grid_from_args, run=run_shared_from_args,
                       json_default=Path("benchmarks/results/shared_prompt_cpu.json"))


if __name__ == "__main__":
    raise SystemExit(main())

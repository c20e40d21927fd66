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

``probe-cost``: what prefill once's row-exactness check costs against the prefill it saves
(cold, warm, check off, DynamicCache; ``probe-cost --help``)::

    python benchmarks/shared_prompt.py probe-cost --threads 1 2 --prompts 512 2048 \\
        --json benchmarks/results/prefill_probe_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

import hf_vkv  # noqa: F401  (registers "vkv")
import hf_vkv.generate.prefill_once as prefill_once
import hf_vkv.generate.row_exactness as row_exactness
from hf_vkv.ab.bench_args import add_shared_prompt_arguments, shared_grid_from_args, run_shared_from_args, script_main
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model
from common import dispatch, write_report


def default_main(argv: list[str]) -> int:
    return script_main(argv, doc=__doc__, script="benchmarks/shared_prompt.py",
                       add=lambda parser: add_shared_prompt_arguments(parser, standalone=True),
                       make_grid=shared_grid_from_args, run=run_shared_from_args,
                       json_default=Path("benchmarks/results/shared_prompt_cpu.json"))


# ---------------------------------------- probe-cost (formerly benchmarks/prefill_probe_cost.py)
PROBE_COST_DOC = """What prefill once's row-exactness check costs, against the prefill it saves.

Prefill once (``hf_vkv.generate.prefill_once``) admits each call of the prompt's forward by a rule
(``hf_vkv.generate.row_exactness``): elementwise transcendental calls by the vector loop's
structure (no probe), matmuls, attention and reductions by a proof on synthetic operands of the
call's layout, made the first time the call's signature is seen in the process. On the embedded
SmolLM2 (fp32, n=8 sampling, one new token) this times, per prompt length and thread count:

* ``cold``: vkv's TTFT with no proof kept (the first prompt of that length in the process: every
  signature proved, three synthetic draws each on 1x and 8x the rows);
* ``warm``: the median of ``--rounds`` later calls (proofs kept: the rule's checks and the
  dispatch of the torch function mode);
* ``unchecked``: the same prefill once with the check switched off (no torch function mode, the
  head still on every row) - what the proof costs when warm is ``warm - unchecked``;
* ``dynamic``: DynamicCache's TTFT (one call): the prefill prefill once saves is ``dynamic - warm``.

    python benchmarks/shared_prompt.py probe-cost --threads 1 2 --prompts 512 2048 \\
        --json benchmarks/results/prefill_probe_cost.json
"""


class _Unchecked(contextlib.nullcontext):
    """Stands in for RowExactness: no torch function mode, nothing probed."""

    def __init__(self, **_: int) -> None:
        super().__init__()
        self.expanded = 0
        self.watching = False
        self.base_calls = 0


def _ttft(model, ids: torch.Tensor, *, cache: bool) -> tuple[float, str]:
    extra = {"cache_implementation": "vkv"} if cache else {}
    torch.manual_seed(0)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=True,
                         num_return_sequences=8, return_dict_in_generate=True, **extra)
    seconds = time.perf_counter() - start
    return seconds, out.past_key_values.stats().prefill_once if cache else "-"


def main_probe_cost(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shared_prompt.py probe-cost", description=PROBE_COST_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/prefill_probe_cost.json"))
    args = parser.parse_args(argv)
    model = load_default_model()[0]
    cells = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for tokens in args.prompts:
            ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(tokens))
            _ttft(model, ids[:, :8], cache=True)  # warm up the process (allocator, first-call costs)
            row_exactness.clear_verdicts()
            cold, said = _ttft(model, ids, cache=True)
            probed = len(row_exactness._VERDICTS)
            warm, unchecked = [], []
            real = prefill_once.RowExactness
            for _ in range(args.rounds):  # interleaved
                warm.append(_ttft(model, ids, cache=True)[0])
                prefill_once.RowExactness = _Unchecked
                try:
                    unchecked.append(_ttft(model, ids, cache=True)[0])
                finally:
                    prefill_once.RowExactness = real
            dynamic = _ttft(model, ids, cache=False)[0]
            cell = {"threads": threads, "prompt_tokens": tokens, "rows": 8, "cold_s": cold,
                    "warm_s": statistics.median(warm), "unchecked_s": statistics.median(unchecked),
                    "dynamic_s": dynamic, "signatures_probed": probed, "prefill_once": said,
                    "warm_rounds_s": warm, "unchecked_rounds_s": unchecked}
            cell["probe_cost_s"] = cell["cold_s"] - cell["warm_s"]
            cell["check_overhead_warm_s"] = cell["warm_s"] - cell["unchecked_s"]
            cell["prefill_saved_s"] = cell["dynamic_s"] - cell["warm_s"]
            cell["cold_over_dynamic"] = cold / dynamic
            cell["warm_over_dynamic"] = cell["warm_s"] / dynamic
            cells.append(cell)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in cell.items()
                   if not k.endswith("rounds_s")}, flush=True)
    command = "python " + " ".join([sys.argv[0], "probe-cost", *argv])
    write_report(args.json, {"benchmark": "prefill_probe_cost", "environment": describe_environment(model, command=command),
                             "cells": cells})
    return 0


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"probe-cost": main_probe_cost})


if __name__ == "__main__":
    raise SystemExit(main())

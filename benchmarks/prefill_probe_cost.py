"""What prefill once's row-exactness check costs, against the prefill it saves.

Prefill once (``hf_vkv.prefill_once``) checks every matmul, attention, reduction and
transcendental call of the prompt's forward against its expansion to DynamicCache's rows the first
time the call's signature is seen in the process (``hf_vkv.row_exactness``). On the embedded
SmolLM2 (fp32, n=8 sampling, one new token) this times, per prompt length and thread count:

* ``cold``: vkv's TTFT with no verdict cached (the first prompt of that length in the process:
  every signature probed on 8x the rows);
* ``warm``: the median of ``--rounds`` later calls (verdicts cached: only the dispatch of the
  torch function mode);
* ``unchecked``: the same prefill once with the check switched off (no torch function mode, the
  head still on every row) - what the proof costs when warm is ``warm - unchecked``;
* ``dynamic``: DynamicCache's TTFT (one call): the prefill prefill once saves is ``dynamic - warm``.

    python benchmarks/prefill_probe_cost.py --threads 1 2 --prompts 512 2048 \
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
import hf_vkv.prefill_once as prefill_once
import hf_vkv.row_exactness as row_exactness
from common import write_report
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model


class _Unchecked(contextlib.nullcontext):
    """Stands in for RowExactness: no torch function mode, nothing probed."""

    def __init__(self, **_: int) -> None:
        super().__init__()
        self.expanded = 0
        self.watching = False


def _ttft(model, ids: torch.Tensor, *, cache: bool) -> tuple[float, str]:
    extra = {"cache_implementation": "vkv"} if cache else {}
    torch.manual_seed(0)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=True,
                         num_return_sequences=8, return_dict_in_generate=True, **extra)
    seconds = time.perf_counter() - start
    return seconds, out.past_key_values.stats().prefill_once if cache else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    write_report(args.json, {"benchmark": "prefill_probe_cost", "environment": describe_environment(model, command=command),
                             "cells": cells})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

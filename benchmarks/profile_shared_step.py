"""Where a decode step of a shared-prompt workload spends its time under vkv: the step, and the
part of it in ``VKVCache.reorder_cache`` (beam search) and ``LayerGroup.prepare`` (growth and
copy-on-write), with the model's own attention and with ``"vkv_cascade"``.

A step's time is (generate of 1 + N new tokens - generate of 1 new token) / N; the wrappers' time
covers the same N steps (the first run's is dropped). SmolLM2 fp32, one thread.

    python benchmarks/profile_shared_step.py --prompt 2048 --mode beam4 \\
        --json benchmarks/results/profile_shared_step_2048_beam4.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import write_report
from hf_vkv import VKVCache
from hf_vkv.ab.harness import describe_environment
from hf_vkv.cache.group import LayerGroup
from hf_vkv.default_model import load_default_model

MODES = {"beam4": dict(num_beams=4, do_sample=False), "sample8": dict(do_sample=True, num_return_sequences=8)}


def _timed(cls: type, name: str, spent: dict[str, float]) -> None:
    original = getattr(cls, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

    setattr(cls, name, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--mode", choices=sorted(MODES), default="beam4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_default_model()[0]
    ids = torch.randint(100, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    spent: dict[str, float] = {}
    _timed(VKVCache, "reorder_cache", spent)
    _timed(LayerGroup, "prepare", spent)
    rows = []
    for attention in ("sdpa", "vkv_cascade"):
        model.set_attn_implementation(attention)
        times = {}
        for new in (1, 1 + args.steps):
            spent.clear()
            torch.manual_seed(0)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="vkv", max_new_tokens=new,
                           min_new_tokens=new, **MODES[args.mode])
            times[new] = (time.perf_counter() - start, dict(spent))
        (t1, s1), (tn, sn) = times[1], times[1 + args.steps]
        row = {"attention": attention, "step_ms": (tn - t1) / args.steps * 1e3,
               **{f"{k}_ms_per_step": (sn.get(k, 0.0) - s1.get(k, 0.0)) / args.steps * 1e3 for k in sn}}
        rows.append(row)
        print(row, flush=True)
    if args.json:
        write_report(Path(args.json), {"benchmark": "profile_shared_step", "prompt": args.prompt, "mode": args.mode,
                                       "steps": args.steps, "rows": rows,
                                       "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


if __name__ == "__main__":
    main()

"""Where a decode step of a shared-prompt workload spends its time under vkv: the step, and the
part of it in ``VKVCache.reorder_cache`` (beam search) and ``LayerGroup.prepare`` (growth and
copy-on-write), with the model's own attention and with ``"vkv_cascade"``.

A step's time is (generate of 1 + N new tokens - generate of 1 new token) / N; the wrappers'
time is measured in the long run alone, over its decode-phase calls only (``prepare`` calls that
write one token, every ``reorder_cache`` but the first), so the prefill's noise never enters it.
SmolLM2 fp32, ``--threads`` intra-op threads (one by default).

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


def _timed(cls: type, name: str, spent: dict[str, list[float]], decode: Any) -> None:
    """Wrap ``cls.name`` to record the seconds of each call that ``decode(args)`` says belongs to
    a decode step (the prefill's calls are left out, not subtracted)."""
    original = getattr(cls, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            if decode(args):
                spent.setdefault(name, []).append(time.perf_counter() - start)

    setattr(cls, name, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--mode", choices=sorted(MODES), default="beam4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_default_model()[0]
    ids = torch.randint(100, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    spent: dict[str, list[float]] = {}
    # prepare(batch, start, end): a decode step writes one token; every reorder follows a step's token choice
    _timed(LayerGroup, "prepare", spent, lambda a: len(a) == 3 and a[2] - a[1] == 1)
    _timed(VKVCache, "reorder_cache", spent, lambda a: True)
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
            times[new] = time.perf_counter() - start
        # the long run's decode-phase calls: prepare once per group per step; reorders after each
        # step's token choice but the first (which follows the prefill)
        reorders = spent.get("reorder_cache", [])[1:]
        row = {"attention": attention, "step_ms": (times[1 + args.steps] - times[1]) / args.steps * 1e3,
               "prepare_ms_per_step": sum(spent.get("prepare", [])) / args.steps * 1e3,
               "reorder_cache_ms_per_step": sum(reorders) / max(len(reorders), 1) * 1e3,
               "reorder_cache_calls": len(reorders)}
        rows.append(row)
        print(row, flush=True)
    if args.json:
        write_report(Path(args.json), {"benchmark": "profile_shared_step", "prompt": args.prompt, "mode": args.mode,
                                       "steps": args.steps, "threads": args.threads, "rows": rows,
                                       "method": "step_ms: (generate of 1 + steps new tokens - generate of 1) / "
                                       "steps; prepare and reorder_cache: perf_counter around each decode-phase "
                                       "call of the long run (prepare calls writing one token; reorders after "
                                       "the first), summed per step",
                                       "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


if __name__ == "__main__":
    main()

"""Decode speed with and without the safety checks on the decode path (a shape check per update, the mapping budget per page crossing) (CPU, embedded SmolLM2).

The checks a decode step can meet: the shape check of every ``update`` (``GroupGeometry.check``)
and, at each page crossing, the mapping budget (``VirtualBuffer._mapping_change`` +
``MapBudget.check``). "off" replaces them with no-ops in the same process; the two modes run
interleaved, one intra-op thread, ``--rounds`` rounds, and the median ms per decode step of each
is reported (prefill excluded, :class:`common.StepClock`). Both modes must give the same tokens.

    HF_HUB_OFFLINE=1 python benchmarks/checks_overhead.py --json benchmarks/results/checks_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from common import StepClock, write_report

import hf_vkv  # noqa: F401
from hf_vkv.cache.geometry import GroupGeometry
from hf_vkv.default_model import load_default_model
from hf_vkv.memory.map_budget import MapBudget
from hf_vkv.memory.virtual_buffer import VirtualBuffer


@contextmanager
def checks_off():
    saved = (GroupGeometry.check, VirtualBuffer._mapping_change, MapBudget.check)
    GroupGeometry.check = lambda self, layer, k, v: None
    VirtualBuffer._mapping_change = lambda self, plan, changed: (0, 0)
    MapBudget.check = lambda self, needed: None
    try:
        yield
    finally:
        GroupGeometry.check, VirtualBuffer._mapping_change, MapBudget.check = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layout", default=None, help="cache_config['layout'] (default: the CPU's, head-major)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/checks_overhead_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    model, _ = load_default_model(dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (args.batch, args.prompt), generator=g)
    config = {} if args.layout is None else {"layout": args.layout}

    def run() -> tuple[float, torch.Tensor]:
        clock = StepClock()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                 min_new_tokens=args.new, do_sample=False, cache_implementation="vkv",
                                 cache_config=config, streamer=clock, pad_token_id=0)
        return clock.step_seconds() * 1e3, out

    run()  # warm-up
    times: dict[str, list[float]] = {"on": [], "off": []}
    outs = {}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            if mode == "off":
                with checks_off():
                    ms, outs[mode] = run()
            else:
                ms, outs[mode] = run()
            times[mode].append(ms)
    same = torch.equal(outs["on"], outs["off"])
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    report = {
        "command": "python " + " ".join(sys.argv),
        "model": "SmolLM2-135M-Instruct (embedded, fp32)", "threads": 1,
        "prompt": args.prompt, "batch": args.batch, "new_tokens": args.new, "rounds": args.rounds,
        "layout": args.layout or "head_major (CPU default)",
        "ms_per_step": {"checks_on": times["on"], "checks_off": times["off"]},
        "median_ms_per_step": {"checks_on": round(on, 3), "checks_off": round(off, 3)},
        "ratio_on_over_off": round(on / off, 4), "same_tokens": same,
    }
    print(f"checks on {on:.2f} ms/step, off {off:.2f} ms/step, ratio {on / off:.4f}, same tokens: {same}")
    write_report(args.json, report)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

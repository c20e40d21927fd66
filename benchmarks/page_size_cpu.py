"""Decode speed and memfd bytes per host page size (head-major, CPU): the measurement behind the
host's page_bytes range of 4 KiB .. 2 MiB (hf_vkv/memory/limits.py).

Embedded SmolLM2-135M fp32, one intra-op thread, page sizes interleaved per round, median ms per
decode step (prefill excluded) and the memfd bytes the cache holds at the end; all sizes must give
the same tokens.

    HF_HUB_OFFLINE=1 python benchmarks/page_size_cpu.py --json benchmarks/results/page_size_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

from common import StepClock, write_report

import hf_vkv  # noqa: F401
from hf_vkv.default_model import load_default_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", type=int, nargs="+", default=[4096, 65536, 2 << 20])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/page_size_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    model, _ = load_default_model(dtype=torch.float32)
    ids = torch.randint(10, model.config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))

    def run(page: int) -> tuple[float, int, torch.Tensor]:
        clock = StepClock()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                 min_new_tokens=args.new, do_sample=False, cache_implementation="vkv",
                                 cache_config={"layout": "head_major", "page_bytes": page}, streamer=clock,
                                 pad_token_id=0, return_dict_in_generate=True)
        held = sum(a.backend.resident_bytes() for a in out.past_key_values._arenas.values() if not a.closed)
        return clock.step_seconds() * 1e3, held, out.sequences

    run(args.pages[0])
    times: dict[int, list[float]] = {p: [] for p in args.pages}
    held, seqs = {}, {}
    for _ in range(args.rounds):
        for page in args.pages:
            ms, held[page], seqs[page] = run(page)
            times[page].append(ms)
    same = all(torch.equal(seqs[p], seqs[args.pages[0]]) for p in args.pages)
    rows = {str(p): {"ms_per_step": times[p], "median_ms_per_step": round(statistics.median(times[p]), 3),
                     "memfd_bytes": held[p]} for p in args.pages}
    for p in args.pages:
        print(f"page {p:>8}: {statistics.median(times[p]):7.2f} ms/step, memfd {held[p] / 2**20:8.1f} MiB")
    write_report(args.json, {"command": "python " + " ".join(sys.argv), "model": "SmolLM2-135M-Instruct (embedded, fp32)",
                             "threads": 1, "prompt": args.prompt, "batch": args.batch, "new_tokens": args.new,
                             "rounds": args.rounds, "layout": "head_major", "pages": rows, "same_tokens": same})
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

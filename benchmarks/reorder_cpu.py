"""What one beam reorder costs: ``reorder_cache`` of DynamicCache and of vkv in each layout,
timed inside real beam-search ``generate()`` calls.

On the embedded SmolLM2-135M (fp32), 4 beams from one random prompt, ``--new`` new tokens. Every
call of ``reorder_cache`` after the first (which follows the prefill) is timed with
``perf_counter`` around the call, so each cache is timed on the beam indices and cache state its
own search produced (the A/B tests check those searches are token-identical). Per run the median
call; per cache the median over ``--rounds`` rounds, caches interleaved in one process (rotated by
round), at each of ``--threads``. DynamicCache (``index_select`` of every layer) and the ideal
cache of the benchmarks (its preallocated buffers, the prompt loaded into every row, reordered by
copying the rows in place) pay the copy that vkv's page tables avoid.

Also recorded per vkv layout: pages copied by reorders (tails copied in place) and rows that
remapped, per call, read from the cache's page tables.

    python benchmarks/reorder_cpu.py --prompt 2048 --threads 1 2 \\
        --json benchmarks/results/reorder_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from common import ideal_beam_cache, write_report
from hf_vkv import VKVCache
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.ideal import IdealCache
from hf_vkv.default_model import load_default_model

#: Caches timed: DynamicCache, the ideal (``None`` both) and vkv in every layout (``{}``: the default
#: for the workload).
CACHES: dict[str, dict[str, Any] | None] = {
    "dynamic": None,
    "ideal": None,
    "vkv_default": {},
    "vkv_head_major": {"layout": "head_major"},
    "vkv_token_major": {"layout": "token_major"},
    "vkv_static": {"layout": "static"},
    "vkv_paged": {"layout": "paged"},
}


class _Timer:
    """Wraps ``reorder_cache`` of a class and records each call's seconds and its cache."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.cache: Any = None

    def install(self, cls: type) -> None:
        original = cls.reorder_cache
        timer = self

        def reorder_cache(self: Any, beam_idx: torch.Tensor) -> Any:
            start = time.perf_counter()
            try:
                return original(self, beam_idx)
            finally:
                timer.calls.append(time.perf_counter() - start)
                timer.cache = self

        cls.reorder_cache = reorder_cache


def _counters(cache: Any) -> tuple[int, int]:
    """Tail pages copied and rows remapped by the reorders of a vkv cache (0, 0 for others)."""
    if not isinstance(cache, VKVCache):
        return 0, 0
    tables = [g.buffer.table for g in cache.groups if g.buffer is not None and not g.buffer.closed]
    return sum(t.tail_copies for t in tables), sum(t.remapped_rows for t in tables)


def run(model: Any, ids: torch.Tensor, name: str, new: int, timer: _Timer) -> dict[str, Any]:
    """One beam-search generate() with cache ``name``: its reorder calls' median and counters."""
    options = CACHES[name]
    kwargs: dict[str, Any] = {} if options is None else {"cache_implementation": "vkv", "cache_config": options}
    if name == "ideal":  # its buffers hold the prompt: generate's first call of reorder_cache is already a step's
        kwargs = {"past_key_values": ideal_beam_cache(model, ids, beams=4, new=new)}
    model.set_attn_implementation("vkv_paged" if name == "vkv_paged" else "sdpa")
    timer.calls, timer.cache = [], None
    with torch.inference_mode():  # (load_prompt fills the ideal's buffers in it: every cache runs in it)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, num_beams=4,
                       do_sample=False, **kwargs)
    calls = timer.calls[1:]  # the first follows the prefill
    copies, remapped = _counters(timer.cache)
    return {"median_ms": statistics.median(calls) * 1e3, "calls": len(timer.calls),
            "tail_copies": copies, "remapped_rows": remapped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import hf_vkv  # noqa: F401  (registers "vkv" and "vkv_paged")

    model = load_default_model()[0]
    ids = torch.randint(100, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    timer = _Timer()
    timer.install(DynamicCache)
    timer.install(VKVCache)
    timer.install(IdealCache)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        got: dict[str, list[dict[str, Any]]] = {name: [] for name in args.caches}
        for r in range(args.rounds):
            order = args.caches[r % len(args.caches):] + args.caches[:r % len(args.caches)]
            for name in order:
                got[name].append(run(model, ids, name, args.new, timer))
        for name, runs in got.items():
            row = {"threads": threads, "cache": name,
                   "reorder_ms": statistics.median(x["median_ms"] for x in runs),
                   "rounds_ms": [round(x["median_ms"], 3) for x in runs],
                   "calls_per_run": runs[0]["calls"],
                   "tail_copies_per_call": runs[0]["tail_copies"] / runs[0]["calls"],
                   "remapped_rows_per_call": runs[0]["remapped_rows"] / runs[0]["calls"]}
            rows.append(row)
            print(row, flush=True)
    if args.json:
        write_report(Path(args.json), {
            "benchmark": "reorder_cpu", "prompt": args.prompt, "beams": 4, "new_tokens": args.new,
            "rounds": args.rounds, "method": "perf_counter around each reorder_cache call of a real beam-search "
            "generate() (the first call, after the prefill, dropped); median call per run, median over rounds; "
            "caches interleaved, rotated by round",
            "rows": rows, "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


if __name__ == "__main__":
    main()

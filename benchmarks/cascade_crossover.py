"""Where reading a shared prefix once pays: one layer's decode attention, sdpa over every row's
keys against :func:`hf_vkv.attention.cascade.cascade_decode`, over shared-prefix length x rows.

SmolLM2-135M's attention geometry by default (9 query heads, 3 key/value heads, head dim 64),
float32, one query per row, each row's keys at their own addresses (as a cache hands them: the
shared prefix is the same bytes, but sdpa reads it once per row), a suffix of ``--suffix`` tokens
per row. Median of ``--repeats`` timings per cell, the two paths interleaved, one thread.

    python benchmarks/cascade_crossover.py --json benchmarks/results/cascade_crossover.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from common import write_report
from hf_vkv.ab.harness import describe_environment
from hf_vkv.attention.cascade import cascade_decode
from hf_vkv.kv_records import Cluster, SharedPrefix


def _time(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def cell(prefix: int, rows: int, *, suffix: int, heads: int, kv_heads: int, dim: int, repeats: int) -> dict[str, Any]:
    """One (prefix, rows) cell: median seconds of sdpa and of the cascade, and their max |diff|."""
    g = torch.Generator().manual_seed(prefix * 100 + rows)
    total = prefix + suffix
    shared_k = torch.randn(kv_heads, prefix, dim, generator=g)
    shared_v = torch.randn(kv_heads, prefix, dim, generator=g)
    key = torch.randn(rows, kv_heads, total, dim, generator=g)
    value = torch.randn(rows, kv_heads, total, dim, generator=g)
    key[:, :, :prefix] = shared_k
    value[:, :, :prefix] = shared_v
    query = torch.randn(rows, heads, 1, dim, generator=g)
    record = SharedPrefix(clusters=(Cluster(index=tuple(range(rows)), tokens=prefix),), alone=())
    scale = dim ** -0.5

    def plain() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True)

    def cascade() -> torch.Tensor:
        return cascade_decode(query, key, value, mask=None, scale=scale, prefix=record)

    sdpa_s, cascade_s = [], []
    for _ in range(repeats):  # interleaved
        sdpa_s += _time(plain, 1)
        cascade_s += _time(cascade, 1)
    a, b = statistics.median(sdpa_s), statistics.median(cascade_s)
    return {"prefix": prefix, "rows": rows, "suffix": suffix, "sdpa_ms": a * 1e3, "cascade_ms": b * 1e3,
            "cascade_over_sdpa": b / a, "max_abs_diff": (plain() - cascade()).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cells = []
    for prefix in args.prefixes:
        for rows in args.rows:
            c = cell(prefix, rows, suffix=args.suffix, heads=args.heads, kv_heads=args.kv_heads, dim=args.dim,
                     repeats=args.repeats)
            cells.append(c)
            print(f"prefix {prefix:5d} rows {rows}: sdpa {c['sdpa_ms']:7.3f} ms  cascade {c['cascade_ms']:7.3f} ms  "
                  f"ratio {c['cascade_over_sdpa']:.2f}  max|diff| {c['max_abs_diff']:.1e}", flush=True)
    if args.json:
        report = {"benchmark": "cascade_crossover", "threads": args.threads,
                  "environment": describe_environment(command="python " + " ".join(sys.argv)), "cells": cells}
        write_report(__import__("pathlib").Path(args.json), report)


if __name__ == "__main__":
    main()

"""One layer's 4-beam decode attention at a long shared prefix, by kernel: sdpa over every row,
the cascade of an earlier commit and of the working tree, and the stacked prefix part alone in
three ways (torch's CPU flash kernel, matmul-softmax-matmul, MKL's packed GEMM), against a plain
streaming read of the same keys and values.

SmolLM2-135M's attention geometry (9 query heads, 3 key/value heads, head dim 64), float32, 4
rows whose keys alias one buffer per layer over the prefix (as pages shared by beams do) at a
cache's strides (each row's heads ``--capacity`` tokens apart), ``--suffix`` own tokens per row.
``--layers`` such buffers are read in turn, as a model's layers are, so each read comes from
beyond the core's caches; per kernel the median over ``--repeats`` passes of the time per layer.

    python benchmarks/cascade_prefix_kernels.py --before 3b7466b --threads 1 \\
        --json benchmarks/results/cascade_prefix_kernels_t1.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from cascade_kernel_ab import kernel_at
from common import write_report
from hf_vkv.ab.harness import describe_environment
from hf_vkv.attention import cascade
from hf_vkv.kv_records import Cluster, SharedPrefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit whose cascade_decode is timed too")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, hq, hkv, d, p = args.rows, 9, 3, 64, args.prefix
    g, t, m, scale = hq // hkv, p + args.suffix, args.rows * 3, 64 ** -0.5
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        k = torch.randn(1, hkv, args.capacity, d, generator=gen).expand(n, -1, -1, -1)[:, :, :t]
        v = torch.randn(1, hkv, args.capacity, d, generator=gen).expand(n, -1, -1, -1)[:, :, :t]
        packed = [(torch.ops.mkl._mkl_reorder_linear_weight(k[0, h, :p].contiguous(), m), k[0, h, :p].contiguous(),
                   torch.ops.mkl._mkl_reorder_linear_weight(v[0, h, :p].t().contiguous(), m), v[0, h, :p].t().contiguous())
                  for h in range(hkv)]
        layers.append((k, v, packed))
    query = torch.randn(n, hq, 1, d, generator=gen)
    stacked = query.reshape(n, hkv, g, d).transpose(0, 1).reshape(hkv, n * g, d)
    record = SharedPrefix(clusters=(Cluster(index=tuple(range(n)), tokens=p),), alone=())
    before = kernel_at(args.before)

    def packed_gemm(layer: Any) -> list[torch.Tensor]:
        outs = []
        for h, (pk, k_h, pv, vt_h) in enumerate(layer[2]):
            scores = torch.ops.mkl._mkl_linear(stacked[h], pk, k_h, None, m).mul_(scale)
            outs.append(torch.ops.mkl._mkl_linear(torch.softmax(scores, -1), pv, vt_h, None, m))
        return outs

    kernels: dict[str, Callable[[Any], Any]] = {
        "sdpa_all_rows": lambda l: F.scaled_dot_product_attention(query, l[0], l[1], scale=scale, enable_gqa=True),
        "cascade_before": lambda l: before(query, l[0], l[1], mask=None, scale=scale, prefix=record),
        "cascade_after": lambda l: cascade.cascade_decode(query, l[0], l[1], mask=None, scale=scale, prefix=record),
        "prefix_flash": lambda l: cascade._CPU_FLASH(stacked[None], l[0][:1, :, :p], l[1][:1, :, :p], scale=scale),
        "prefix_matmul_softmax_matmul": lambda l: torch.matmul(torch.softmax(
            torch.matmul(stacked, l[0][0, :, :p].transpose(-1, -2)).mul_(scale), -1), l[1][0, :, :p]),
        "prefix_mkl_packed_gemm": packed_gemm,
        "prefix_streaming_read": lambda l: l[0][0, :, :p].sum() + l[1][0, :, :p].sum(),
    }
    reference = kernels["sdpa_all_rows"](layers[0])
    diffs = {name: (kernels[name](layers[0]) - reference).abs().max().item() for name in ("cascade_before", "cascade_after")}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.repeats):
        for name, kernel in kernels.items():  # interleaved
            start = time.perf_counter()
            for layer in layers:
                kernel(layer)
            times[name].append((time.perf_counter() - start) / len(layers))
    per_layer_us = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    for name, us in per_layer_us.items():
        print(f"{name:30s} {us:8.1f} us per layer", flush=True)
    print("max |diff| against sdpa:", diffs)
    if args.json:
        write_report(Path(args.json), {
            "benchmark": "cascade_prefix_kernels", "threads": args.threads, "before": args.before, "prefix": p,
            "suffix": args.suffix, "rows": n, "layers": args.layers, "repeats": args.repeats,
            "per_layer_us": per_layer_us, "max_abs_diff_vs_sdpa": diffs,
            "environment": describe_environment(command="python " + " ".join(sys.argv))})


if __name__ == "__main__":
    main()

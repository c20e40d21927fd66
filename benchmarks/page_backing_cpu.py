"""Does attention read memfd pages as fast as ordinary memory? SDPA decode over the same K/V shapes
in anonymous memory (``torch.randn``) and in host-backend pages mapped into a reservation.

One decode step's attention for SmolLM2-135M's shapes (30 layers, 9 query / 3 key-value heads,
head dim 64, fp32) over ``--tokens`` cached tokens and ``--batch`` rows; the two memories are timed
alternately, ``--rounds`` times, on one intra-op thread; the median is reported.

    python benchmarks/page_backing_cpu.py --json benchmarks/results/page_backing_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hf_vkv.ab.harness import describe_environment
from hf_vkv.memory.host_backend import HostBackend
from hf_vkv.memory.pool import PageId
from common import write_report

LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64


def _memfd_states(backend: HostBackend, shape: tuple[int, ...], first_page: int) -> torch.Tensor:
    """A ``shape`` fp32 tensor on fresh host-backend pages ``first_page ..`` mapped in order."""
    nbytes = torch.Size(shape).numel() * 4
    pages = [PageId(first_page + i) for i in range(nbytes // backend.page_bytes)]
    address = backend.reserve(nbytes)
    backend.create(pages)
    backend.map(address, pages)
    t = backend.tensor(address, nbytes, owner=backend).view(torch.float32).view(shape)
    t.copy_(torch.randn(shape))
    return t


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    shape = (args.batch, KV_HEADS, args.tokens, DIM)
    backend = HostBackend(page_bytes=4096, name="hf_vkv-page-backing")
    per_tensor = torch.Size(shape).numel() * 4 // backend.page_bytes
    backend.ensure_id_space(2 * LAYERS * per_tensor)
    memories = {
        "anonymous": [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)],
        "memfd": [(_memfd_states(backend, shape, (2 * i) * per_tensor),
                   _memfd_states(backend, shape, (2 * i + 1) * per_tensor)) for i in range(LAYERS)],
    }
    query = torch.randn(args.batch, HEADS, 1, DIM)

    def step(states: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        for k, v in states:
            torch.nn.functional.scaled_dot_product_attention(query, k, v, enable_gqa=True)
        return time.perf_counter() - t0

    for states in memories.values():  # warm-up
        step(states)
    times: dict[str, list[float]] = {name: [] for name in memories}
    for r in range(args.rounds):
        for name in (list(memories) if r % 2 else list(reversed(memories))):
            times[name].append(1000 * step(memories[name]))
    median = {name: statistics.median(v) for name, v in times.items()}
    command = " ".join(["python", "benchmarks/page_backing_cpu.py", *sys.argv[1:]])
    return dict(schema="hf_vkv.page_backing_cpu/1", command=command, batch=args.batch, tokens=args.tokens,
                rounds=args.rounds, ms_per_step=median, ms_per_step_runs=times,
                memfd_over_anonymous=median["memfd"] / median["anonymous"],
                environment=describe_environment(command=command), time=time.strftime("%Y-%m-%d %H:%M:%S"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = run(args)
    print(f"SDPA over {LAYERS} layers, batch {args.batch} x {args.tokens} tokens: "
          + ", ".join(f"{n} {v:.1f} ms" for n, v in report["ms_per_step"].items())
          + f"; memfd / anonymous {report['memfd_over_anonymous']:.3f}")
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()

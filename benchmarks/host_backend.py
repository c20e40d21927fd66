"""Per-operation cost of the host (memfd + mmap) backend at 4 KiB, 64 KiB and 2 MiB pages.

Each operation is timed one call at a time (``time.perf_counter_ns``) over many calls, in rounds
of a batch of pages so that memory stays bounded:

* ``map``: ``backend.map`` of one page at its slot of a reservation (``mmap MAP_FIXED``);
* ``first touch``: writing a whole freshly mapped page for the first time (page faults + zeroing
  + the write);
* ``touch (resident)``: writing the same page again, the baseline that ``first touch`` pays over;
* ``copy, fresh dst``: ``backend.copy`` of one resident page to a page never touched (a
  copy-on-write into a newly created page: the copy pays the destination's first touch);
* ``copy, resident dst``: the same into a resident page (a copy-on-write into a recycled page);
* ``unmap``: ``backend.unmap`` of one page (re-reserving it ``PROT_NONE``);
* ``release``: ``backend.release`` of one unmapped page (``fallocate(PUNCH_HOLE)``).

Writes go through torch (``fill_``, ``copy_``) on one thread. Prints a table (median and p90 in
microseconds) and writes JSON with the machine, the library versions and the exact command line.

    python benchmarks/host_backend.py            # the full run (about 15 s on 2 cores)
    python benchmarks/host_backend.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch

from common import write_report  # benchmarks/common.py
from hf_vkv.ab.harness import describe_environment
from hf_vkv.memory import HostBackend, PageId

PAGE_SIZES = (4 << 10, 64 << 10, 2 << 20)
OPS = ("map", "first touch", "touch (resident)", "copy, fresh dst", "copy, resident dst", "unmap", "release")
# (calls per operation, pages per round) for each page size; --quick divides the calls by 10.
PLAN = {4 << 10: (20_000, 512), 64 << 10: (5_000, 256), 2 << 20: (600, 32)}


def timed(fn, *args) -> int:
    t0 = time.perf_counter_ns()
    fn(*args)
    return time.perf_counter_ns() - t0


def measure(page_bytes: int, calls: int, batch: int) -> dict[str, list[int]]:
    """Nanoseconds of each call of each operation, ``calls`` calls each."""
    backend = HostBackend(page_bytes=page_bytes, name="hf_vkv-bench")
    backend.ensure_id_space(2 * batch)  # ids [0, batch) are mapped and touched, [batch, 2 batch) take copies
    address = backend.reserve(batch * page_bytes)
    view = backend.tensor(address, batch * page_bytes, owner=None)  # uint8 [batch * page_bytes]
    backend.copy([(PageId(0), PageId(0))])  # builds the pool view once, outside the timings
    times: dict[str, list[int]] = {op: [] for op in OPS}
    # Every round starts from pages that are neither mapped nor resident.
    while len(times["map"]) < calls:
        n = min(batch, calls - len(times["map"]))
        pages = [PageId(i) for i in range(n)]
        for i in range(n):
            times["map"].append(timed(backend.map, address + i * page_bytes, [pages[i]]))
        for i in range(n):
            times["first touch"].append(timed(view[i * page_bytes:(i + 1) * page_bytes].fill_, i % 251 + 1))
        for i in range(n):
            times["touch (resident)"].append(timed(view[i * page_bytes:(i + 1) * page_bytes].fill_, i % 241 + 2))
        for name in ("copy, fresh dst", "copy, resident dst"):
            for i in range(n):
                times[name].append(timed(backend.copy, [(pages[i], PageId(batch + i))]))
        for i in range(n):
            times["unmap"].append(timed(backend.unmap, address + i * page_bytes, 1))
        for i in range(n):
            times["release"].append(timed(backend.release, [pages[i]]))
        backend.release([PageId(batch + i) for i in range(n)])  # the copies, untimed
        assert backend.resident_bytes() == 0, "a page stayed resident: the timings would not be of first touches"
    del view
    backend.unreserve(address, batch * page_bytes)
    backend.close()
    return times


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the calls (a few seconds)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_backend.json",
                        help="where to write the JSON (default: %(default)s)")
    args = parser.parse_args()
    # One thread: a page is too small for torch's thread pool to pay off, and waking it up (on a
    # busy 2-core machine, tens of milliseconds) would be timed instead of the memory.
    torch.set_num_threads(1)

    results = []
    for page_bytes in PAGE_SIZES:
        calls, batch = PLAN[page_bytes]
        calls = max(calls // 10, batch) if args.quick else calls
        times = measure(page_bytes, calls, batch)
        for op in OPS:
            results.append({
                "page_bytes": page_bytes, "op": op, "calls": len(times[op]),
                "median_us": round(percentile(times[op], 0.5), 3), "p90_us": round(percentile(times[op], 0.9), 3),
            })

    env = describe_environment(device="cpu")
    header = f"{'operation':<20}" + "".join(f"{f'{p >> 10} KiB median':>16}{'p90':>10}" for p in PAGE_SIZES)
    print(f"host backend, microseconds per call ({env['cpu_count']} CPUs, Linux {env['kernel']})")
    print(header)
    print("-" * len(header))
    for op in OPS:
        row = {r["page_bytes"]: r for r in results if r["op"] == op}
        print(f"{op:<20}" + "".join(f"{row[p]['median_us']:>16.2f}{row[p]['p90_us']:>10.2f}" for p in PAGE_SIZES))

    report = {
        "benchmark": "host_backend",
        "command": env["command"],
        "quick": args.quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": env["platform"], "processor": env["processor"], "cpu_count": int(env["cpu_count"]),
            "kernel": env["kernel"],
        },
        "versions": {k: env[k] for k in ("python", "torch", "hf_vkv")},
        "torch_threads": int(env["torch_threads"]),
        "results": results,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()

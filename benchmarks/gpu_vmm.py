"""Latency of each CUDA virtual-memory driver call for one page (2 MiB on H100/H200), side by side
with vAttention's published A100 figures.

Calls are made through ``hf_vkv.cuda.Driver`` (``cuda.bindings.driver``), one page at a time, the
device idle, timed with ``time.perf_counter`` around each call (so Python's call overhead, a
microsecond or two, is included, as it is for the backend). Also timed: one ``cuMemSetAccess``
and one ``cuMemUnmap`` over a run of many pages (what the backend does for a run), and the
backend's own ``map`` of a page (map + set access) and ``unmap`` (synchronize + unmap).

    python benchmarks/gpu_vmm.py                 # 512 pages, writes benchmarks/results/gpu_vmm.json
    python benchmarks/gpu_vmm.py --pages 64      # a quick run

Exits with a message on a machine without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from common import write_report  # benchmarks/common.py
from hf_vkv.ab.harness import describe_environment

#: vAttention (Prabhu et al., "vAttention: Dynamic Memory Management for Serving LLMs without
#: PagedAttention"), A100, per 2 MB page, microseconds: the figures quoted by the project's issue.
VATTENTION_A100_US = {"create": 29, "map": 2, "set_access": 38, "unmap": 34, "release": 23}


def summarize(samples: list[float]) -> dict:
    """Microseconds: median, p90, mean, min over the samples (seconds in)."""
    us = sorted(s * 1e6 for s in samples)
    return {"n": len(us), "median_us": round(statistics.median(us), 2), "p90_us": round(us[int(0.9 * (len(us) - 1))], 2),
            "mean_us": round(statistics.fmean(us), 2), "min_us": round(us[0], 2)}


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def measure_driver(device: torch.device, pages: int) -> tuple[int, dict]:
    from hf_vkv.cuda import Driver

    d = Driver(device.index)
    page = d.granularity()
    t: dict[str, list[float]] = {k: [] for k in ("reserve", "create", "map", "set_access", "unmap", "release",
                                                 "address_free")}
    dt, base = timed(d.reserve, pages * page, page)
    t["reserve"].append(dt)
    handles = []
    for i in range(pages):
        dt, h = timed(d.create, page)
        t["create"].append(dt)
        handles.append(h)
    for i, h in enumerate(handles):
        t["map"].append(timed(d.map, base + i * page, page, h)[0])
        t["set_access"].append(timed(d.set_access, base + i * page, page)[0])
    torch.cuda.synchronize(device)
    for i in range(pages):
        t["unmap"].append(timed(d.unmap, base + i * page, page)[0])
    # runs: map all, one set-access over the run, one unmap over the run
    for i, h in enumerate(handles):
        d.map(base + i * page, page, h)
    run_access, _ = timed(d.set_access, base, pages * page)
    torch.cuda.synchronize(device)
    run_unmap, _ = timed(d.unmap, base, pages * page)
    for h in handles:
        t["release"].append(timed(d.release, h)[0])
    t["address_free"].append(timed(d.address_free, base, pages * page)[0])
    out = {k: summarize(v) for k, v in t.items()}
    out["set_access_run"] = {"pages": pages, "total_us": round(run_access * 1e6, 1),
                             "per_page_us": round(run_access * 1e6 / pages, 3)}
    out["unmap_run"] = {"pages": pages, "total_us": round(run_unmap * 1e6, 1),
                        "per_page_us": round(run_unmap * 1e6 / pages, 3)}
    return page, out


def measure_backend(device: torch.device, pages: int) -> dict:
    """The backend's map (cuMemMap + cuMemSetAccess) and unmap (synchronize + cuMemUnmap) of one page."""
    from hf_vkv.cuda import CudaBackend
    from hf_vkv.memory import PageId

    b = CudaBackend(device, create_ahead=pages, max_pages=pages)
    b.ensure_id_space(pages)
    create_batch, _ = timed(b.create, [PageId(i) for i in range(pages)])
    base = b.reserve(pages * b.page_bytes)
    maps, unmaps = [], []
    for i in range(pages):
        maps.append(timed(b.map, base + i * b.page_bytes, [PageId(i)])[0])
    for i in range(pages):
        unmaps.append(timed(b.unmap, base + i * b.page_bytes, 1)[0])
    b.unreserve(base, pages * b.page_bytes)
    # A readable reservation: the scratch page at every slot (one cuMemMap per slot, one
    # cuMemSetAccess over the range), then given back with one cuMemUnmap.
    fill, readable = timed(lambda: b.reserve(pages * b.page_bytes, readable=True))
    drop, _ = timed(b.unreserve, readable, pages * b.page_bytes)
    b.close()
    return {"readable_reserve": {"pages": pages, "total_ms": round(fill * 1e3, 3),
                                 "per_slot_us": round(fill * 1e6 / pages, 3),
                                 "unreserve_total_ms": round(drop * 1e3, 3)},
            "counters": b.counters(),
            "create_ahead_batch": {"pages": pages, "total_ms": round(create_batch * 1e3, 2),
                                   "per_page_us": round(create_batch * 1e6 / pages, 2)},
            "map_page": summarize(maps), "unmap_page": summarize(unmaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_vmm.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_vmm.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    torch.empty(1, device=device)  # the primary context, current on this thread
    env = describe_environment(device=device)  # device, driver/torch CUDA, versions, command
    measure_driver(device, min(args.pages, 16))  # warm-up: first calls pay one-time driver costs
    page, calls = measure_driver(device, args.pages)
    backend = measure_backend(device, args.pages)
    result = {"environment": env, "page_bytes": page, "pages": args.pages, "driver_calls": calls,
              "backend": backend, "vattention_a100_us": VATTENTION_A100_US}
    print(f"{env['device']}, driver CUDA {env['driver_cuda_version']}, page {page // (1 << 20)} MiB, "
          f"{args.pages} pages")
    print(f"{'call':<14}{'median µs':>11}{'p90 µs':>9}{'vAttention A100 µs':>20}")
    for name in ("reserve", "create", "map", "set_access", "unmap", "release", "address_free"):
        s = calls[name]
        ref = VATTENTION_A100_US.get(name, "")
        print(f"{name:<14}{s['median_us']:>11}{s['p90_us']:>9}{ref:>20}")
    print(f"set_access over {args.pages} pages: {calls['set_access_run']['per_page_us']} µs/page; "
          f"unmap over the run: {calls['unmap_run']['per_page_us']} µs/page")
    print(f"backend map of a page: {backend['map_page']['median_us']} µs; unmap: {backend['unmap_page']['median_us']} µs")
    r = backend["readable_reserve"]
    print(f"readable reservation of {r['pages']} pages: {r['per_slot_us']} µs per slot (scratch map + access)")
    write_report(args.out, result)


if __name__ == "__main__":
    main()

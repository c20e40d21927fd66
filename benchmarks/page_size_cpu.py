"""Decode speed and memfd bytes per host page size (head-major, CPU): the measurement behind the
host's page_bytes range of 4 KiB .. 2 MiB (hf_vkv/memory/limits.py).

Embedded SmolLM2-135M fp32, one intra-op thread, page sizes interleaved per round, median ms per
decode step (prefill excluded) and the memfd bytes the cache holds at the end; all sizes must give
the same tokens.

    HF_HUB_OFFLINE=1 python benchmarks/page_size_cpu.py --json benchmarks/results/page_size_cpu.json

More subcommands on the host memory's costs, each with its own ``--help``:

* ``backing``: SDPA over memfd pages against anonymous memory (``results/page_backing_cpu.json``);
* ``host-backend``: each host-backend call (map, first touch, copy, unmap, punch hole) at 4 KiB,
  64 KiB and 2 MiB pages (``results/host_backend.json``);
* ``checks``: decode with and without the safety checks of the decode path
  (``results/checks_overhead_cpu.json``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import hf_vkv  # noqa: F401
from hf_vkv.ab.harness import describe_environment
from hf_vkv.cache.geometry import GroupGeometry
from hf_vkv.default_model import load_default_model
from hf_vkv.memory import HostBackend, PageId
from hf_vkv.memory.map_budget import MapBudget
from hf_vkv.memory.virtual_buffer import VirtualBuffer
from common import StepClock, dispatch, write_report


def default_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", type=int, nargs="+", default=[4096, 65536, 2 << 20])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/page_size_cpu.json"))
    args = parser.parse_args(argv)
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


# ---------------------------------------- backing (formerly benchmarks/page_backing_cpu.py)
BACKING_DOC = """Does attention read memfd pages as fast as ordinary memory? SDPA decode over the same K/V shapes
in anonymous memory (``torch.randn``) and in host-backend pages mapped into a reservation.

One decode step's attention for SmolLM2-135M's shapes (30 layers, 9 query / 3 key-value heads,
head dim 64, fp32) over ``--tokens`` cached tokens and ``--batch`` rows; the two memories are timed
alternately, ``--rounds`` times, on one intra-op thread; the median is reported.

    python benchmarks/page_size_cpu.py backing --json benchmarks/results/page_backing_cpu.json
"""


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
    command = " ".join(["python", "benchmarks/page_size_cpu.py", *sys.argv[1:]])
    return dict(schema="hf_vkv.page_backing_cpu/1", command=command, batch=args.batch, tokens=args.tokens,
                rounds=args.rounds, ms_per_step=median, ms_per_step_runs=times,
                memfd_over_anonymous=median["memfd"] / median["anonymous"],
                environment=describe_environment(command=command), time=time.strftime("%Y-%m-%d %H:%M:%S"))


def main_backing(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="page_size_cpu.py backing", description=BACKING_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = run(args)
    print(f"SDPA over {LAYERS} layers, batch {args.batch} x {args.tokens} tokens: "
          + ", ".join(f"{n} {v:.1f} ms" for n, v in report["ms_per_step"].items())
          + f"; memfd / anonymous {report['memfd_over_anonymous']:.3f}")
    if args.json:
        write_report(args.json, report)


# ---------------------------------------- host-backend (formerly benchmarks/host_backend.py)
HOST_BACKEND_DOC = """Per-operation cost of the host (memfd + mmap) backend at 4 KiB, 64 KiB and 2 MiB pages.

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

    python benchmarks/page_size_cpu.py host-backend            # the full run (about 15 s on 2 cores)
    python benchmarks/page_size_cpu.py host-backend --quick    # a few seconds
"""


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


def main_host_backend(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="page_size_cpu.py host-backend", description=HOST_BACKEND_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tenth of the calls (a few seconds)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_backend.json",
                        help="where to write the JSON (default: %(default)s)")
    args = parser.parse_args(argv)
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


# ---------------------------------------- checks (formerly benchmarks/checks_overhead.py)
CHECKS_DOC = """Decode speed with and without the safety checks on the decode path (a shape check per update, the mapping budget per page crossing) (CPU, embedded SmolLM2).

The checks a decode step can meet: the shape check of every ``update`` (``GroupGeometry.check``)
and, at each page crossing, the mapping budget (``VirtualBuffer._mapping_change`` +
``MapBudget.check``). "off" replaces them with no-ops in the same process; the two modes run
interleaved, one intra-op thread, ``--rounds`` rounds, and the median ms per decode step of each
is reported (prefill excluded, :class:`common.StepClock`). Both modes must give the same tokens.

    HF_HUB_OFFLINE=1 python benchmarks/page_size_cpu.py checks --json benchmarks/results/checks_overhead_cpu.json
"""


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


def main_checks(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="page_size_cpu.py checks", description=CHECKS_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layout", default=None, help="cache_config['layout'] (default: the CPU's, head-major)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/checks_overhead_cpu.json"))
    args = parser.parse_args(argv)
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


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"backing": main_backing,
                                         "host-backend": main_host_backend,
                                         "checks": main_checks})


if __name__ == "__main__":
    raise SystemExit(main())

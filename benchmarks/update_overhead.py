"""What the cache's own Python costs per decode step: ``VKVCache.update`` of every layer, no model.

SmolLM2-135M's geometry (30 layers, 3 KV heads of 64, float32), a batch of 4 rows holding
``--prompt`` tokens; one step is the 30 layers' ``update`` of one new token each (what a model's
attention layers call), timed over ``--steps`` steps. Attention is not run, so the figure is the
cache's page-table and view work alone: the part of a decode step a refactoring of the cache can
change. With the head-major layout's 4 KiB pages a sub-row's page holds 16 tokens, so one step in
16 takes pages (the page-table transaction) and the others stay in the rows' last pages (the fast
path); the figure is their mean over ``--steps`` steps.

Each (threads, layout) cell has its own cache; a round times ``--steps`` steps of every cell in
turn (interleaved, so a burst of load on the machine hits every cell alike), ``--rounds`` rounds,
the median per cell. Each round is timed twice: wall time, and the CPU time of the thread that
runs the steps (``time.thread_time``), which leaves out the time the thread waits for a core (on
an idle machine the two agree: the steps' work is this thread's Python).

``--checkouts NAME=PATH ...`` compares checkouts (directories holding an ``hf_vkv`` package): one
worker process per checkout holds its caches, and every round runs each cell in every checkout
in turn (the order rotates from round to round), so the checkouts see the same load; the report
adds, per cell, the median over rounds of each checkout's time over the first checkout's in the
same round. The budget and the measured figures are in ``docs/benchmarks.md`` ("Per-step
overhead budget")::

    PYTHONPATH=. python benchmarks/update_overhead.py --threads 1 2 --json out.json
    python benchmarks/update_overhead.py --threads 1 2 --checkouts before=../old after=. --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

import hf_vkv
from common import write_report
from hf_vkv import VKVCache
from hf_vkv.ab.harness import describe_environment

LAYERS = 30


class Cells:
    """One checkout's caches, one per layout, each holding the prompt's tokens."""

    def __init__(self, args: argparse.Namespace) -> None:
        tokens = args.prompt + args.steps * args.rounds * len(args.threads) + 8
        config = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                             intermediate_size=64, vocab_size=64, max_position_embeddings=tokens)
        # what a model from from_pretrained runs (its default): with no attention named the cache takes eager's,
        # and token-major then copies its reads at every step (exact for eager's matmul, O(tokens) a step)
        config._attn_implementation = "sdpa"
        self.steps = args.steps
        self.caches: dict[str, VKVCache] = {}
        self.names: dict[str, str] = {}  # layout argument -> the layout the cache chose
        with torch.no_grad():
            for layout in args.layouts:
                cache = VKVCache(config, **({} if layout == "default" else {"layout": layout}))
                prompt = torch.randn(args.batch, 3, args.prompt, 64)
                for layer in range(LAYERS):
                    cache.update(prompt, prompt, layer)
                self.caches[layout], self.names[layout] = cache, str(cache.layout)
        self.new = torch.randn(args.batch, 3, 1, 64)

    def round(self, threads: int, layout: str) -> tuple[float, float]:
        """Time ``steps`` steps of one cell: (wall, thread CPU) microseconds per step."""
        torch.set_num_threads(threads)
        cache, new = self.caches[layout], self.new
        with torch.no_grad():
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(self.steps):
                for layer in range(LAYERS):
                    cache.update(new, new, layer)
            cpu = time.thread_time() - cpu
            wall = time.perf_counter() - start
        return wall / self.steps * 1e6, cpu / self.steps * 1e6


def _worker(args: argparse.Namespace) -> int:
    """A checkout's worker: build the caches, then time the cell named on each line of stdin."""
    cells = Cells(args)
    print(json.dumps({"layouts": cells.names, "hf_vkv": os.path.dirname(hf_vkv.__file__),
                      "hf_vkv_version": hf_vkv.__version__}), flush=True)
    for line in sys.stdin:
        threads, layout = line.split()
        print(json.dumps(cells.round(int(threads), layout)), flush=True)
    return 0


def _summary(times: list[tuple[float, float]]) -> dict[str, object]:
    wall, cpu = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    return {"us_per_step": wall, "us_per_layer_update": wall / LAYERS, "cpu_us_per_step": cpu,
            "cpu_us_per_layer_update": cpu / LAYERS, "rounds_us_per_step": [t[0] for t in times],
            "rounds_cpu_us_per_step": [t[1] for t in times]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="intra-op thread counts (interleaved)")
    parser.add_argument("--layouts", nargs="+", default=["default"],
                        help="layouts (interleaved); 'default' is the device's (head-major on the CPU)")
    parser.add_argument("--checkouts", nargs="+", default=None, metavar="NAME=PATH",
                        help="compare these checkouts, round by round (the first is the reference)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    cells = [(t, layout) for t in args.threads for layout in args.layouts]
    times: dict[str, dict[tuple[int, str], list[tuple[float, float]]]] = {}
    if args.checkouts is None:
        local = Cells(args)
        times["this"] = {cell: [] for cell in cells}
        for _ in range(args.rounds):
            for cell in cells:
                times["this"][cell].append(local.round(*cell))
        checkouts = {"this": {"layouts": local.names, "hf_vkv": os.path.dirname(hf_vkv.__file__),
                              "hf_vkv_version": hf_vkv.__version__}}
    else:
        paths = dict(item.split("=", 1) for item in args.checkouts)
        worker_args = ["--prompt", str(args.prompt), "--batch", str(args.batch), "--steps", str(args.steps),
                       "--rounds", str(args.rounds), "--threads", *map(str, args.threads), "--layouts", *args.layouts]
        workers, checkouts = {}, {}
        for name, path in paths.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(path).resolve()), str(Path(__file__).parent)])}
            workers[name] = subprocess.Popen([sys.executable, __file__, *worker_args, "--worker"], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            checkouts[name] = json.loads(workers[name].stdout.readline())
            times[name] = {cell: [] for cell in cells}
        names = list(paths)
        for r in range(args.rounds):
            for cell in cells:
                for name in names[r % len(names):] + names[:r % len(names)]:
                    workers[name].stdin.write(f"{cell[0]} {cell[1]}\n")
                    workers[name].stdin.flush()
                    times[name][cell].append(tuple(json.loads(workers[name].stdout.readline())))
        for worker in workers.values():
            worker.stdin.close()
            worker.wait()
    results = []
    reference = next(iter(times))
    for name, per_cell in times.items():
        for threads, layout in cells:
            entry = {"checkout": name, "threads": threads, "layout": checkouts[name]["layouts"][layout],
                     **_summary(per_cell[threads, layout])}
            pairs = list(zip(per_cell[threads, layout], times[reference][threads, layout]))
            if name != reference:  # paired by round: the load of that moment divides out
                entry["wall_over_reference"] = statistics.median(a[0] / b[0] for a, b in pairs)
                entry["cpu_over_reference"] = statistics.median(a[1] / b[1] for a, b in pairs)
            results.append(entry)
            ratio = f", {entry['cpu_over_reference']:.3f}x {reference}'s CPU" if name != reference else ""
            print(f"{name}: threads {threads}, {entry['layout']}: {entry['us_per_step']:.0f} us per step wall, "
                  f"{entry['cpu_us_per_step']:.0f} us CPU ({entry['cpu_us_per_layer_update']:.1f} us per layer update)"
                  f"{ratio}; rounds CPU {[round(t) for t in entry['rounds_cpu_us_per_step']]}")
    if args.json:
        command = "python benchmarks/update_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(Path(args.json), {"command": command, "environment": describe_environment(command=command),
                                       "load_average": list(os.getloadavg()), "checkouts": checkouts,
                                       "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How cost grows with n: KV bytes, time to first token and decode step of generate() for n
sampled rows and n beams of one prompt, DynamicCache against vkv and the ideal cache, plotted.

On the embedded SmolLM2-135M (fp32, CPU), through the shared-prompt cells of
:mod:`hf_vkv.ab.shared_prompt` (the same code as ``hf-vkv bench --shared-prompt``: caches
interleaved in one process, the median of ``--rounds``, vkv's tokens and logits compared with
DynamicCache's). Workloads ``sampleN`` (``num_return_sequences=N``) and ``beamN``. Per cell it
adds the physical limit — the KV of P + nG tokens (the prompt once, each row's own tokens), G
the tokens generated — and DynamicCache's n(P + G), from the model's bytes per token; vkv's KV is
what its pages hold (resident memfd bytes, the peak over the run). A DynamicCache run estimated
past ``--dynamic-limit-s`` is skipped, and one the machine cannot hold is recorded as out of
memory; both are named in the JSON. One untimed cell of every cache runs first. Plots: per prompt length, KV bytes, TTFT and decode step
against n, one line per cache and the limit.

    python benchmarks/scaling_grid.py --prompts 128 512 2048 --n 1 2 4 8 16 32 64 --beams 2 4 8 \\
        --rounds 1 --decode-steps 4 --threads 1 --json benchmarks/results/scaling_grid_1t.json \\
        --plot docs/images/scaling_grid_1t.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import write_report  # noqa: E402

import hf_vkv  # noqa: E402,F401  (registers "vkv")
from hf_vkv.ab.harness import describe_environment  # noqa: E402
from hf_vkv.ab.probes import kv_bytes_per_token  # noqa: E402
from hf_vkv.ab.shared_prompt import SharedPromptGrid, run_cell  # noqa: E402
from hf_vkv.default_model import load_default_model  # noqa: E402


def _workloads(ns: list[int], beams: list[int]) -> list[tuple[str, int]]:
    out = [("greedy" if n == 1 else f"sample{n}", n) for n in ns]
    return out + [(f"beam{b}", b) for b in beams]


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = sorted({c["prompt"] for c in cells})
    fig, axes = plt.subplots(len(prompts), 3, figsize=(15, 3.6 * len(prompts)), squeeze=False)
    for row, prompt in zip(axes, prompts):
        for kind, marker in (("sample", "o"), ("beam", "s")):
            sel = sorted((c for c in cells if c["prompt"] == prompt and c["kind"] in (kind, "greedy")),
                         key=lambda c: c["n"])
            if kind == "beam":
                sel = [c for c in sel if c["kind"] == "beam"]
            if not sel:
                continue
            ns = [c["n"] for c in sel]
            for cache, style in (("dynamic", "-"), ("vkv", "-"), ("vkv_cascade", "--"), ("ideal", ":")):
                mem = [c["caches"].get(cache, {}).get("kv_peak_bytes") for c in sel]
                ttft = [c["caches"].get(cache, {}).get("ttft_s") for c in sel]
                step = [c["caches"].get(cache, {}).get("decode_step_ms") for c in sel]
                label = f"{cache} ({kind})"
                for ax, ys in zip(row, (mem, ttft, step)):
                    pts = [(n, y) for n, y in zip(ns, ys) if y is not None]
                    if pts:
                        ax.plot(*zip(*pts), style, marker=marker, label=label)
            row[0].plot(ns, [c["limit_bytes"] for c in sel], "k--", label=f"limit P + nG ({kind})")
        for ax, title in zip(row, ("KV bytes (peak)", "time to first token (s)", "decode step (ms)")):
            ax.set_title(f"{title}, prompt {prompt}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("n (rows or beams)")
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--beams", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--caches", nargs="+", default=["dynamic", "vkv", "ideal"])
    p.add_argument("--dynamic-limit-s", type=float, default=60.0)
    p.add_argument("--context", type=int, default=None,
                   help="positions the model takes (config.max_position_embeddings), for prompts past its trained "
                        "context: the cost of a long prompt does not depend on what the weights were trained for, "
                        "its tokens are still compared with DynamicCache's")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/scaling_grid.json"))
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--plot-only", action="store_true", help="draw --plot from the cells of --json (a finished run), "
                   "running nothing")
    args = p.parse_args()
    if args.plot_only:
        import json

        plot(json.loads(args.json.read_text())["cells"], args.plot)
        return 0
    model, _ = load_default_model()
    trained = model.config.max_position_embeddings
    if args.context is not None:
        model.config.max_position_embeddings = args.context
    per_token = kv_bytes_per_token(model)
    report: dict[str, Any] = dict(
        benchmark="scaling_grid", command=" ".join([sys.executable, *sys.argv]), environment=describe_environment(model),
        threads=args.threads, rounds=args.rounds, decode_steps=args.decode_steps, kv_bytes_per_token=per_token,
        context=model.config.max_position_embeddings, trained_context=trained,
        limit="(P + n*G) * bytes per token, G = decode steps + 1 tokens generated per row",
        dynamic_bytes="n * (P + G) * bytes per token", complete=False, cells=[])
    skipped: dict[str, str] = {}
    warm = SharedPromptGrid(prompt_lengths=(32,), workloads=("sample2",), decode_steps=1, rounds=1,
                            caches=tuple(args.caches), threads=args.threads)
    run_cell(model, 32, "sample2", warm, skipped=skipped)  # untimed: first calls (allocator, kernels) of every cache
    for prompt in args.prompts:
        for workload, n in _workloads(args.n, args.beams):
            grid = SharedPromptGrid(prompt_lengths=(prompt,), workloads=(workload,), decode_steps=args.decode_steps,
                                    rounds=args.rounds, caches=tuple(args.caches), dynamic_limit_s=args.dynamic_limit_s,
                                    threads=args.threads)
            t = time.perf_counter()
            cell = run_cell(model, prompt, workload, grid, skipped=skipped)
            g = args.decode_steps + 1
            cell.update(n=n, kind="beam" if workload.startswith("beam") else "greedy" if n == 1 else "sample",
                        limit_bytes=(prompt + n * g) * per_token, dynamic_model_bytes=n * (prompt + g) * per_token,
                        seconds=time.perf_counter() - t)
            vkv = cell["caches"].get("vkv", {}).get("kv_peak_bytes")
            cell["vkv_over_limit"] = None if vkv is None else vkv / cell["limit_bytes"]
            cell["vkv_over_dynamic"] = None if vkv is None else vkv / cell["dynamic_model_bytes"]
            report["cells"].append(cell)
            c = cell["caches"]
            print(f"P={prompt:5d} {workload:9s} vkv KV {vkv / 2**20 if vkv else float('nan'):8.1f} MiB "
                  f"({cell['vkv_over_limit'] or float('nan'):.3f}x limit, {cell['vkv_over_dynamic'] or float('nan'):.3f}x "
                  f"Dynamic) TTFT vkv {c.get('vkv', {}).get('ttft_s') or float('nan'):.3f} s dyn "
                  f"{c.get('dynamic', {}).get('ttft_s') or float('nan'):.3f} s; step vkv "
                  f"{c.get('vkv', {}).get('decode_step_ms') or float('nan'):.1f} ms dyn "
                  f"{c.get('dynamic', {}).get('decode_step_ms') or float('nan'):.1f} ms; identical "
                  f"{c.get('vkv', {}).get('tokens_identical')}; skipped {list(cell['skipped'])}", flush=True)
            write_report(args.json, report)
    report["complete"] = True
    write_report(args.json, report)
    if args.plot is not None:
        plot(report["cells"], args.plot)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())

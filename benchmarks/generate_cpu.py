"""Decode step and KV memory of the vkv layouts against DynamicCache and an ideal cache (CPU).

On the embedded SmolLM2-135M (fp32). A thin script over :mod:`hf_vkv.ab.bench` (the same code as
``hf-vkv bench``; only the default grid differs). Per cell (prompt length x batch): ms per decode
step of DynamicCache, the ideal cache (K/V preallocated at full capacity, narrow views, no copy)
and each vkv layout, each layout's ratio to the ideal cache and to DynamicCache, and each vkv
cache's ``stats().utilization``. The prompt is prefilled once per prompt length and loaded into
every cache through its own ``update()``; the decode steps of the caches run interleaved on one
intra-op thread, ``--rounds`` times, and the median round is reported; every cache must choose
DynamicCache's tokens at every step (exit status 1 otherwise).

The full grid (prompts 64/512/2048/8192, batches 1/4/8, 24 new tokens, 3 rounds; the 8192 x 8
cell holds four caches of ~3 GiB each at once, ~14 GiB of memory in all)::

    HF_HUB_OFFLINE=1 python benchmarks/generate_cpu.py --threads 2 \\
        --json benchmarks/results/generate_cpu_decode.json

A quick grid (prompts 64/512, batches 1/4, 16 new tokens)::

    python benchmarks/generate_cpu.py --quick --json /tmp/quick.json

``--modes beam4 sample8`` adds generate() A/B runs (DynamicCache against the default vkv cache;
KV memory of beam search and parallel sampling) at every cell with a batch <= 4.

``profile``: where one cell's decode step goes, per cache (every step timed, then the steps under
``torch.profiler`` with each cache's ``update`` wrapped); ``profile --help`` for its options::

    python benchmarks/generate_cpu.py profile --prompt 64 --batch 8 --caches ideal dynamic head_major
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers.cache_utils import Cache

from hf_vkv.ab.bench import Grid, make_cache, prompt_ids
from hf_vkv.ab.bench_args import add_arguments, grid_from_args, run_from_args, script_main
from hf_vkv.ab.decode import load_prompt, prefill
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model
from common import dispatch, write_report


def default_main(argv: list[str]) -> int:
    return script_main(argv, doc=__doc__, script="benchmarks/generate_cpu.py",
                       add=lambda parser: add_arguments(parser, default="full"), make_grid=grid_from_args,
                       run=run_from_args, json_default=Path("benchmarks/results/generate_cpu_decode.json"))


# ---------------------------------------- profile (formerly benchmarks/profile_decode.py)
PROFILE_DOC = """Where a decode step's time goes, per cache: the profile behind a benchmark cell's ratio.

For one cell (prompt length x batch) of ``benchmarks/generate_cpu.py`` it loads the same prompt
into each cache (:mod:`hf_vkv.ab.decode`), then

1. times every decode step of every cache, interleaved, ``--rounds`` times (median per step):
   a step that maps new pages stands out against the steps that only write;
2. runs the steps again under ``torch.profiler`` with each cache's ``update`` wrapped in a
   ``record_function("cache.update")``: the time inside the cache (its Python and its copies)
   and the operators whose self time differs most between caches.

    HF_HUB_OFFLINE=1 python benchmarks/generate_cpu.py profile --prompt 64 --batch 8 \\
        --json benchmarks/results/profile_decode_64x8.json
"""


def _wrap_update(cache: Cache) -> None:
    """Mark every ``update`` of ``cache`` in the profile (an instance attribute over the method)."""
    update = cache.update

    def marked(*args: Any, **kwargs: Any) -> Any:
        with record_function("cache.update"):
            return update(*args, **kwargs)

    cache.update = marked  # type: ignore[method-assign]


@torch.inference_mode()
def _steps(model: Any, cache: Cache, first: torch.Tensor, length: int, new_tokens: int) -> list[float]:
    """``new_tokens`` greedy decode steps from ``first`` ``[B]``; the seconds of each."""
    batch = first.shape[0]
    tokens, out = first, []
    for t in range(new_tokens):
        positions = torch.full((batch, 1), length + t, dtype=torch.long)
        mask = torch.ones(batch, length + t + 1, dtype=torch.long)
        t0 = time.perf_counter()
        logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = logits.argmax(-1)
        out.append(time.perf_counter() - t0)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model, _ = load_default_model(dtype=torch.float32)
    # distinct prompts as in the benchmark's cell (8192 prompt tokens prefilled at most)
    ids = prompt_ids(model, args.prompt, Grid(prompt_lengths=(args.prompt,), batches=(args.batch,)).distinct_prompts(args.prompt))
    prompt = prefill(model, ids)
    capacity = args.prompt + args.new_tokens
    first = prompt.first_tokens.index_select(0, prompt.rows(args.batch))

    def fresh() -> dict[str, Cache]:
        caches = {name: make_cache(name, model, args.batch, capacity) for name in args.caches}
        load_prompt(caches, prompt, args.batch)
        return caches

    # 1. per-step wall time, interleaved by round (each round: fresh caches, so the page crossings recur)
    per_step: dict[str, list[list[float]]] = {name: [] for name in args.caches}
    for r in range(args.rounds):
        caches = fresh()
        order = args.caches[r % len(args.caches):] + args.caches[: r % len(args.caches)]
        for name in order:
            per_step[name].append(_steps(model, caches[name], first, args.prompt, args.new_tokens))
        del caches
    step_ms = {name: [1000 * statistics.median(col) for col in zip(*runs)] for name, runs in per_step.items()}

    # 2. the profile of the same steps
    profiles: dict[str, Any] = {}
    caches = fresh()
    for name in args.caches:  # warm-up (allocator, first-call paths), untimed
        _steps(model, caches[name], first, args.prompt, 2)
    caches = fresh()
    for name in args.caches:
        _wrap_update(caches[name])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _steps(model, caches[name], first, args.prompt, args.new_tokens)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / 1000 / args.new_tokens
        update = next((e.cpu_time_total / 1000 / args.new_tokens for e in events if e.key == "cache.update"), 0.0)
        ops = {e.key: e.self_cpu_time_total / 1000 / args.new_tokens for e in events if e.key != "cache.update"}
        calls = {e.key: e.count / args.new_tokens for e in events}
        profiles[name] = dict(profiled_ms_per_step=total, cache_update_ms_per_step=update,
                              self_ms_per_step=ops, calls_per_step=calls)
    base = profiles[args.caches[0]]["self_ms_per_step"]
    for name in args.caches[1:]:
        mine = profiles[name]["self_ms_per_step"]
        diff = {k: mine.get(k, 0.0) - base.get(k, 0.0) for k in set(mine) | set(base)}
        profiles[name]["largest_differences_ms_per_step"] = dict(
            sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top])
    for p in profiles.values():  # keep the report short: the top operators only
        p["self_ms_per_step"] = dict(sorted(p["self_ms_per_step"].items(), key=lambda kv: -kv[1])[: args.top])
        p["calls_per_step"] = {k: p["calls_per_step"][k] for k in p["self_ms_per_step"] if k in p["calls_per_step"]}
    command = " ".join(["python", "benchmarks/generate_cpu.py", *sys.argv[1:]])
    return dict(schema="hf_vkv.profile_decode/1", command=command,
                prompt=args.prompt, batch=args.batch, new_tokens=args.new_tokens, rounds=args.rounds,
                threads=args.threads, caches=args.caches,
                step_ms=step_ms, mean_step_ms={n: statistics.fmean(v) for n, v in step_ms.items()},
                profile=profiles, environment=describe_environment(model, command=command),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


def _print(report: dict[str, Any]) -> None:
    names = report["caches"]
    print(f"prompt {report['prompt']} x batch {report['batch']}, {report['new_tokens']} steps, "
          f"median of {report['rounds']} rounds (ms)")
    print("step " + " ".join(f"{n:>11}" for n in names))
    for t, row in enumerate(zip(*(report["step_ms"][n] for n in names))):
        print(f"{t:4d} " + " ".join(f"{v:11.1f}" for v in row))
    print("mean " + " ".join(f"{report['mean_step_ms'][n]:11.1f}" for n in names))
    for n in names:
        p = report["profile"][n]
        print(f"\n{n}: profiled {p['profiled_ms_per_step']:.1f} ms/step, cache.update {p['cache_update_ms_per_step']:.2f}")
        for k, v in list(p.get("largest_differences_ms_per_step", {}).items())[:8]:
            print(f"   {v:+7.2f} ms  {k}  (vs {names[0]})")


def main_profile(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="generate_cpu.py profile", description=PROFILE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--caches", nargs="+", default=["ideal", "dynamic", "head_major", "token_major"])
    parser.add_argument("--top", type=int, default=15, help="operators kept per cache")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = run(args)
    _print(report)
    if args.json:
        write_report(args.json, report)


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"profile": main_profile})


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a decode step's time goes on a GPU, vkv against DynamicCache: torch.profiler tables.

    python3 benchmarks/gpu_profile_decode.py --context 1024 --batch 8 --json benchmarks/results/gpu_profile_decode.json

For each cache (DynamicCache, vkv with its default layout, vkv token-major): one warm-up generate();
``--rounds`` interleaved timing rounds without the profiler (each cache's 1-token and full
generate() once a round; the decode step is their difference over the steps; medians); then the
same generate() under ``torch.profiler`` (CPU and CUDA activity) unless ``--no-profile``. Records the top operators by
self CPU time and by self device time, each operator's call count per decode step, and the totals,
so the two caches' steps can be compared operator by operator. SmolLM2's shape with random
weights (``gpu_generate.py``'s model), bf16, greedy, deterministic kernels (``hf_vkv.ab.deterministic``).
``--device cpu`` is a smoke run of the script itself.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common import write_report  # noqa: E402
from gpu_generate import load_model  # noqa: E402

import hf_vkv  # noqa: E402,F401  (registers cache_implementation="vkv")
from hf_vkv.ab.deterministic import deterministic_kernels  # noqa: E402
from hf_vkv.ab.harness import describe_environment  # noqa: E402

CACHES = {
    "dynamic": {},
    "vkv": {"cache_implementation": "vkv"},
    "vkv-token": {"cache_implementation": "vkv", "cache_config": {"layout": "token_major"}},
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _generate(model, ids, kwargs: dict, new_tokens: int):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)


def _wall(model, ids, kwargs: dict, new_tokens: int, device: str) -> float:
    gc.collect()
    _sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        _generate(model, ids, kwargs, new_tokens)
    _sync(device)
    return time.perf_counter() - t


def _table(events, key: str, steps: int, top: int) -> list[dict]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return [dict(name=e.key, calls_per_step=round(e.count / steps, 2),
                 self_cpu_ms=round(e.self_cpu_time_total / 1e3, 3),
                 self_device_ms=round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
                 cpu_total_ms=round(e.cpu_time_total / 1e3, 3)) for e in rows]


def _python_table(model, ids, kwargs: dict, new_tokens: int, device: str, steps: int, top: int) -> list[dict]:
    """cProfile over one generate(): the Python functions with the most time of their own."""
    prof = cProfile.Profile()
    with torch.inference_mode():
        prof.enable()
        _generate(model, ids, kwargs, new_tokens)
        _sync(device)
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [dict(function=f"{Path(f).name}:{line}:{name}", calls_per_step=round(nc / steps, 2),
                 tottime_ms_per_step=round(tt / steps * 1e3, 4), cumtime_ms_per_step=round(ct / steps * 1e3, 4))
            for (f, line, name), (_, nc, tt, ct, _) in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--python", action="store_true", help="also cProfile one generate() per cache (Python self time)")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved timing rounds (each cache's prefill and full generate() once a round; medians)")
    p.add_argument("--no-profile", action="store_true", help="timing rounds only, no torch.profiler run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/gpu_profile_decode.json"))
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_profile_decode.py needs a CUDA GPU (--device cpu: a smoke run)")
    model, name = load_model("smollm2-random", torch.bfloat16, device=args.device)
    report = dict(benchmark="gpu_profile_decode", command=" ".join(sys.argv), environment=describe_environment(model),
                  model=name, dtype="bf16", context=args.context, batch=args.batch, new_tokens=args.new_tokens, caches={})
    gen = torch.Generator().manual_seed(args.context * 31 + args.batch)  # gpu_generate.py's prompts
    ids = torch.randint(10, model.config.vocab_size, (args.batch, args.context), generator=gen).to(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    steps = args.new_tokens - 1
    with deterministic_kernels(args.device):
        for cache in args.caches:
            _wall(model, ids, CACHES[cache], 4, args.device)  # warm-up
        rounds: dict[str, list[tuple[float, float]]] = {c: [] for c in args.caches}
        for _ in range(args.rounds):  # interleaved: the caches share whatever the machine does meanwhile
            for cache in args.caches:
                kwargs = CACHES[cache]
                rounds[cache].append((_wall(model, ids, kwargs, 1, args.device),
                                      _wall(model, ids, kwargs, args.new_tokens, args.device)))
        for cache in args.caches:
            steps_ms = sorted((full - prefill) / steps * 1e3 for prefill, full in rounds[cache])
            report["caches"][cache] = r = dict(
                prefill_s=sorted(p for p, _ in rounds[cache])[len(steps_ms) // 2],
                decode_step_ms=steps_ms[len(steps_ms) // 2], decode_step_ms_runs=steps_ms)
            print(f"{cache:10s} decode step median {r['decode_step_ms']:.2f} ms  runs "
                  f"{[round(x, 2) for x in steps_ms]}  prefill {r['prefill_s'] * 1e3:.1f} ms", flush=True)
        if "dynamic" in rounds:
            for cache in args.caches:
                report["caches"][cache]["step_vs_dynamic"] = (report["caches"][cache]["decode_step_ms"]
                                                              / report["caches"]["dynamic"]["decode_step_ms"])
        write_report(args.json, report)
        for cache in [] if args.no_profile else args.caches:
            kwargs, r = CACHES[cache], report["caches"][cache]
            with profile(activities=activities) as prof, torch.inference_mode():
                _generate(model, ids, kwargs, args.new_tokens)
                _sync(args.device)
            events = prof.key_averages()
            r["profiled_self_cpu_ms"] = sum(e.self_cpu_time_total for e in events) / 1e3
            r["profiled_self_device_ms"] = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
            r["by_self_cpu"] = _table(events, "self_cpu_time_total", steps, args.top)
            r["by_self_device"] = (_table(events, "self_device_time_total", steps, args.top)
                                   if args.device == "cuda" else [])
            print(f"{cache:10s} profiled self cpu {r['profiled_self_cpu_ms']:.0f} ms "
                  f"device {r['profiled_self_device_ms']:.0f} ms", flush=True)
            for row in r["by_self_cpu"][:12]:
                print("   cpu ", row, flush=True)
            if args.python:
                r["python_by_tottime"] = _python_table(model, ids, kwargs, args.new_tokens, args.device, steps, args.top)
                for row in r["python_by_tottime"][:15]:
                    print("   py  ", row, flush=True)
            write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compiled decoding on the CPU: vkv's static layout against StaticCache (both compiled) and
DynamicCache (eager), on the embedded SmolLM2-135M (fp32).

For each prompt length and batch it runs ``generate`` with each cache, interleaved round by
round (median of ``--rounds``), and reports the decode time per step (prefill excluded, from a
streamer that records each step's tokens) and the KV bytes each cache holds at the end:
StaticCache's full-capacity buffers, DynamicCache's tensors, vkv's resident pages. Each compiled
configuration is run once, untimed, before the rounds (compilation and warm-up), and the tokens
of every run must equal StaticCache's.

``--capacity N`` gives both static caches room for N tokens per row (a StaticCache built with
``max_cache_len=N``, vkv's ``cache_config={"max_tokens": N}``), as a compiled application does to
keep one shape across requests; without it each holds just the generation's length.
``--samples K`` samples K sequences per prompt (``num_return_sequences``, fixed seed) instead of
greedy decoding: rows of one prompt, which vkv stores once.

    python benchmarks/compile_cpu.py --json benchmarks/results/compile_cpu.json

Subcommand (its own ``--help``): ``mapped``, a hand-driven compiled decode loop over StaticCache,
vkv-static as ``generate`` maps it and vkv-static with every page of the capacity mapped (is
reading the unbacked capacity the cost?)::

    python benchmarks/compile_cpu.py mapped --json benchmarks/results/compile_static_mapped.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig
from transformers.cache_utils import StaticCache

from hf_vkv import VKVCache
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.default_model import load_default_model
from common import StepClock, dispatch, write_report


def _compile_config(backend: str) -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    return config


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model, _ = load_default_model(dtype=torch.float32)
    vocab = model.config.vocab_size
    cells = []
    for prompt in args.prompts:
        for batch in args.batches:
            g = torch.Generator().manual_seed(prompt * 31 + batch)
            ids = torch.randint(10, vocab, (batch, prompt), generator=g)
            common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, return_dict_in_generate=True,
                          **(dict(do_sample=True, num_return_sequences=args.samples, top_k=0, top_p=1.0)
                             if args.samples > 1 else dict(do_sample=False)))
            capacity = {} if args.capacity is None else {"max_tokens": args.capacity}
            configs = {
                "static": dict(cache_implementation="static", compile_config=_compile_config(args.backend)),
                "vkv-static": dict(cache_implementation="vkv", cache_config=capacity,
                                   compile_config=_compile_config(args.backend)),
                "dynamic": dict(disable_compile=True),
            }

            def generate(name: str, **extra: Any) -> Any:
                kwargs = dict(configs[name])
                if name == "static" and args.capacity is not None:  # a StaticCache of that capacity
                    del kwargs["cache_implementation"]
                    kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=args.capacity)
                torch.manual_seed(0)
                return model.generate(**common, **kwargs, **extra)

            torch._dynamo.reset()
            for name in ("static", "vkv-static"):  # compile and warm up, untimed (same shapes as the timed runs)
                generate(name)
            times: dict[str, list[float]] = {name: [] for name in configs}
            kv: dict[str, int] = {}
            tokens: dict[str, torch.Tensor] = {}
            for _ in range(args.rounds):
                for name in configs:
                    clock = StepClock()
                    out = generate(name, streamer=clock)
                    times[name].append(clock.step_seconds() * 1000)
                    kv[name] = kv_bytes(out.past_key_values)
                    tokens[name] = out.sequences
            identical = all(torch.equal(tokens["static"], t) for t in tokens.values())
            step = {name: statistics.median(v) for name, v in times.items()}
            cell = dict(prompt=prompt, batch=batch, capacity=args.capacity, samples=args.samples, ms_per_step=step, ms_per_step_runs=times, kv_bytes=kv,
                        identical_tokens=identical,
                        vkv_over_static_time=step["vkv-static"] / step["static"],
                        vkv_over_static_kv=kv["vkv-static"] / kv["static"])
            cells.append(cell)
            print(f"prompt {prompt:5d} batch {batch} x{args.samples}: " + "  ".join(f"{n} {step[n]:7.1f} ms {kv[n] / 2**20:7.1f} MiB"
                                                                    for n in configs)
                  + f"  vkv/static time {cell['vkv_over_static_time']:.3f} KV {cell['vkv_over_static_kv']:.3f}"
                  + ("" if identical else "  TOKENS DIFFER"), flush=True)
    environment = describe_environment(model)
    return dict(schema="hf_vkv.compile_cpu/1", command=environment["command"], threads=args.threads,
                backend=args.backend, new_tokens=args.new_tokens, rounds=args.rounds,
                environment=environment, cells=cells,
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


def default_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=None, help="tokens per row both static caches hold room for")
    parser.add_argument("--samples", type=int, default=1, help="sequences sampled per prompt (1: greedy)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        write_report(args.json, report)


# ---------------------------------------- mapped (formerly benchmarks/compile_static_mapped.py)
MAPPED_DOC = """Is the compiled vkv-static step slower because it reads unbacked pages? A hand-driven compiled
decode loop over three caches of the same capacity: StaticCache, vkv's static layout as
``generate`` drives it (pages mapped one step ahead, the rest of the capacity reads the zero
page), and vkv's static layout with every page of the capacity mapped after the prefill.

SmolLM2-135M fp32, one thread, inductor, ``model.forward`` compiled once (``fullgraph=True``); the
caches run interleaved step by step, and the median step after two warm steps is reported. The
tokens of every cache must equal StaticCache's.

    python benchmarks/compile_cpu.py mapped --json benchmarks/results/compile_static_mapped.json
"""


@torch.no_grad()
def run_mapped(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, _ = load_default_model(dtype=torch.float32)
    batch, prompt, capacity = args.batch, args.prompt, args.capacity
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    caches: dict[str, Any] = {
        "static": StaticCache(config=model.config, max_cache_len=capacity),
        "vkv-static": VKVCache(model.config, layout="static", batch_size=batch, max_tokens=capacity),
        "vkv-static, all mapped": VKVCache(model.config, layout="static", batch_size=batch, max_tokens=capacity),
    }
    step = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="inductor")
    tokens = {}
    for name, cache in caches.items():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(prompt))
        tokens[name] = out.logits[:, -1:].argmax(-1)
        if name == "vkv-static, all mapped":
            cache.map_ahead(capacity - prompt)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for t in range(args.steps):
        position = torch.tensor([prompt + t])
        for name, cache in caches.items():
            if name == "vkv-static":
                cache.map_ahead(1)  # what generate does before each step
            t0 = time.perf_counter()
            out = step(input_ids=tokens[name], past_key_values=cache, cache_position=position,
                       position_ids=position.expand(batch, 1), use_cache=True)
            times[name].append(1000 * (time.perf_counter() - t0))
            tokens[name] = out.logits[:, -1:].argmax(-1)
    median = {name: statistics.median(v[2:]) for name, v in times.items()}
    command = " ".join(["python", "benchmarks/compile_cpu.py", *sys.argv[1:]])
    return dict(schema="hf_vkv.compile_static_mapped/1", command=command, batch=batch, prompt=prompt,
                capacity=capacity, steps=args.steps, ms_per_step=median, ms_per_step_runs=times,
                kv_bytes={name: kv_bytes(cache) for name, cache in caches.items()},
                identical_tokens=all(torch.equal(tokens["static"], t) for t in tokens.values()),
                environment=describe_environment(model, command=command), time=time.strftime("%Y-%m-%d %H:%M:%S"))


def main_mapped(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="compile_cpu.py mapped", description=MAPPED_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = run_mapped(args)
    print("  ".join(f"{n}: {v:.1f} ms ({report['kv_bytes'][n] / 2**20:.1f} MiB)" for n, v in report["ms_per_step"].items())
          + ("" if report["identical_tokens"] else "  TOKENS DIFFER"))
    if args.json:
        write_report(args.json, report)


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"mapped": main_mapped})


if __name__ == "__main__":
    raise SystemExit(main())

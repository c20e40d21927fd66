"""Is the compiled vkv-static step slower because it reads unbacked pages? A hand-driven compiled
decode loop over three caches of the same capacity: StaticCache, vkv's static layout as
``generate`` drives it (pages mapped one step ahead, the rest of the capacity reads the zero
page), and vkv's static layout with every page of the capacity mapped after the prefill.

SmolLM2-135M fp32, one thread, inductor, ``model.forward`` compiled once (``fullgraph=True``); the
caches run interleaved step by step, and the median step after two warm steps is reported. The
tokens of every cache must equal StaticCache's.

    python benchmarks/compile_static_mapped.py --json benchmarks/results/compile_static_mapped.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import StaticCache

from hf_vkv import VKVCache
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.default_model import load_default_model
from common import write_report


@torch.no_grad()
def run(args: argparse.Namespace) -> dict[str, Any]:
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
    command = " ".join(["python", "benchmarks/compile_static_mapped.py", *sys.argv[1:]])
    return dict(schema="hf_vkv.compile_static_mapped/1", command=command, batch=batch, prompt=prompt,
                capacity=capacity, steps=args.steps, ms_per_step=median, ms_per_step_runs=times,
                kv_bytes={name: kv_bytes(cache) for name, cache in caches.items()},
                identical_tokens=all(torch.equal(tokens["static"], t) for t in tokens.values()),
                environment=describe_environment(model, command=command), time=time.strftime("%Y-%m-%d %H:%M:%S"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = run(args)
    print("  ".join(f"{n}: {v:.1f} ms ({report['kv_bytes'][n] / 2**20:.1f} MiB)" for n, v in report["ms_per_step"].items())
          + ("" if report["identical_tokens"] else "  TOKENS DIFFER"))
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()

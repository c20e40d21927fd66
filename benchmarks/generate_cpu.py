"""Decode speed and KV memory of ``cache_implementation="vkv"`` against DynamicCache and StaticCache.

On the embedded SmolLM2-135M (fp32, CPU). For each prompt length, batch and mode (greedy, beam
search with 4 beams, sampling with n=8) it runs the same ``generate()`` with each cache, side by
side in one process, and reports:

* decode time per step: from the first generated token to the last (prefill excluded), timed by
  a streamer that records when each step's tokens arrive;
* wall time of the whole call;
* KV bytes at the end: DynamicCache's tensors, StaticCache's buffers, VKV's resident pages;
* whether the tokens are identical to DynamicCache's (they must be).

Writes JSON (device, versions, the exact command) and prints a table with ratios to DynamicCache.

    python benchmarks/generate_cpu.py                  # the full grid (tens of minutes on 2 cores)
    python benchmarks/generate_cpu.py --quick          # a small grid
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import hf_vkv
from common import StepClock  # benchmarks/common.py
from hf_vkv.default_model import load_default_model

MODES = {
    "greedy": dict(do_sample=False),
    "beam4": dict(do_sample=False, num_beams=4),
    "sample8": dict(do_sample=True, num_return_sequences=8, top_k=0, top_p=1.0, temperature=1.0),
}
CACHES = ("dynamic", "static", "vkv")


def kv_bytes(cache: object) -> int:
    if isinstance(cache, hf_vkv.VKVCache):
        return cache.stats().resident_bytes
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def run_one(model, input_ids, attention_mask, *, cache: str, mode: str, new_tokens: int, seed: int) -> dict:
    kwargs = dict(MODES[mode])
    kwargs.update(max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True)
    if cache != "dynamic":
        kwargs["cache_implementation"] = cache
    clock = StepClock() if "num_beams" not in kwargs else None  # streamers do not support beam search
    gc.collect()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, streamer=clock,
                             pad_token_id=model.generation_config.eos_token_id, **kwargs)
    wall = time.perf_counter() - t0
    steps = clock.step_seconds() if clock is not None else None
    result = dict(cache=cache, mode=mode, wall_s=wall, decode_step_s=steps, kv_bytes=kv_bytes(out.past_key_values))
    result["_sequences"] = out.sequences
    del out
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="prompts 64 512, batches 1 4, new tokens 16")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/generate_cpu.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.batches, args.new_tokens = [64, 512], [1, 4], 16
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_default_model(dtype=torch.float32)
    vocab = model.config.vocab_size
    rows = []
    for prompt in args.prompts:
        for batch in args.batches:
            for mode in args.modes:
                if mode != "greedy" and batch > 4:
                    continue  # beams / n=8 already multiply the rows
                gen = torch.Generator().manual_seed(prompt * 31 + batch)
                ids = torch.randint(10, vocab, (batch, prompt), generator=gen)
                mask = torch.ones_like(ids)
                results = {}
                for cache in args.caches:
                    r = run_one(model, ids, mask, cache=cache, mode=mode, new_tokens=args.new_tokens, seed=1234)
                    results[cache] = r
                ref = results.get("dynamic")
                sequences = {cache: r.pop("_sequences") for cache, r in results.items()}
                for cache, r in results.items():
                    r.update(prompt=prompt, batch=batch)
                    if ref is not None:
                        r["tokens_identical"] = bool(torch.equal(sequences[cache], sequences["dynamic"]))
                        if r["decode_step_s"] and ref["decode_step_s"]:
                            r["decode_speedup_vs_dynamic"] = ref["decode_step_s"] / r["decode_step_s"]
                        r["wall_ratio_vs_dynamic"] = r["wall_s"] / ref["wall_s"]
                        if ref["kv_bytes"]:
                            r["kv_ratio_vs_dynamic"] = r["kv_bytes"] / ref["kv_bytes"]
                    rows.append(r)
                for cache in args.caches:
                    r = results[cache]
                    print(
                        f"prompt {prompt:5d} batch {batch} {mode:8s} {cache:8s} "
                        f"step {1e3 * r['decode_step_s']:8.1f} ms  " if r["decode_step_s"] else
                        f"prompt {prompt:5d} batch {batch} {mode:8s} {cache:8s} step      n/a     ",
                        f"wall {r['wall_s']:7.2f} s  kv {r['kv_bytes'] / 2**20:8.1f} MiB  "
                        f"speedup {r.get('decode_speedup_vs_dynamic', float('nan')):5.2f}x  "
                        f"wall ratio {r.get('wall_ratio_vs_dynamic', float('nan')):5.2f}  "
                        f"kv ratio {r.get('kv_ratio_vs_dynamic', float('nan')):5.2f}  "
                        f"identical {r.get('tokens_identical')}",
                        flush=True,
                    )
    report = dict(
        benchmark="generate_cpu",
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        device=dict(kind="cpu", processor=platform.processor() or platform.machine(), cores=os.cpu_count(),
                    torch_threads=torch.get_num_threads(), platform=platform.platform()),
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      transformers=transformers.__version__, hf_vkv=hf_vkv.__version__),
        model="SmolLM2-135M-Instruct (fp32)",
        new_tokens=args.new_tokens,
        results=rows,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0 if all(r.get("tokens_identical", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

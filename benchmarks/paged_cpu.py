"""Paged vs contiguous layout on CPU: decode step time, beam reorder cost, block size.

On the embedded SmolLM2-135M (fp32). Side by side in one process, for each prompt length:

* greedy decode time per step (streamer timestamps, prefill excluded) with DynamicCache + sdpa,
  contiguous ``"vkv"`` + sdpa, and paged ``"vkv"`` + ``"vkv_paged"`` at several block sizes;
* beam search (4 beams): wall time and the time spent inside ``reorder_cache`` per step (page-table
  work plus the CoW of partly written tail pages/blocks) for contiguous and paged;
* resident KV bytes, and whether tokens are identical to DynamicCache's (they must be).

On CPU the paged attention gathers each layer's tokens out of the blocks before sdpa (the exact
path), so its decode step carries a copy of the layer's K/V that the contiguous layout avoids;
the numbers say how much that costs and which block size costs least.

    python benchmarks/paged_cpu.py --prompts 512 2048 --batch 4 --blocks 16 64 256

``profile``: contiguous vs paged decode interleaved over rounds, with a ``torch.profiler`` table of
each (``profile --help``)::

    python benchmarks/paged_cpu.py profile --prompt 2048 --batch 4 --rounds 3 --threads 1

``kernels``: the paged attention kernels against sdpa on the same K/V, the Triton kernel on CUDA
and the gather reference on the CPU (``kernels --help``)::

    python benchmarks/paged_cpu.py kernels --device cpu --quick   # results/paged_attention_cpu.json
    python benchmarks/paged_cpu.py kernels --device cuda          # the GPU grid
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.attention.kernels import gather_kv, paged_attention_reference
from hf_vkv.default_model import load_default_model
from hf_vkv.kv_records import PagedKV
from common import StepClock, dispatch, write_report


def run(model, ids, *, attn: str, cache_config: dict | None, new_tokens: int, beams: int) -> dict:
    model.set_attn_implementation(attn)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                  pad_token_id=model.generation_config.eos_token_id)
    if cache_config is not None:
        kwargs.update(cache_implementation="vkv", cache_config=cache_config)
    clock = StepClock() if beams == 1 else None
    reorder_s = [0.0]
    original = Cache.reorder_cache  # DynamicCache's and VKVCache's (per layer: index_select vs page tables)

    def timed_reorder(self, beam_idx):
        t = time.perf_counter()
        original(self, beam_idx)
        reorder_s[0] += time.perf_counter() - t

    Cache.reorder_cache = timed_reorder
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock,
                                 num_beams=beams, **kwargs)
        wall = time.perf_counter() - t0
    finally:
        Cache.reorder_cache = original
        model.set_attn_implementation("sdpa")
    cache = out.past_key_values
    step = clock.step_seconds() if clock is not None else None
    return dict(wall_s=wall, decode_step_s=step, reorder_s_per_step=reorder_s[0] / new_tokens if beams > 1 else None,
                kv_bytes=kv_bytes(cache), _sequences=out.sequences)


def default_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/paged_cpu.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_default_model(dtype=torch.float32)
    variants = [("dynamic", "sdpa", None), ("contiguous", "sdpa", {})]
    variants += [(f"paged-{b}", "vkv_paged", {"block_tokens": b}) for b in args.blocks]
    rows = []
    for prompt in args.prompts:
        ids = torch.randint(10, model.config.vocab_size, (args.batch, prompt), generator=torch.Generator().manual_seed(prompt))
        for mode, beams, batch_ids in (("greedy", 1, ids), ("beam4", 4, ids[:1])):
            results = {}
            for name, attn, config in variants:
                if mode == "beam4" and name.startswith("paged-") and name != f"paged-{args.blocks[0]}":
                    continue  # beams: one block size shows the reorder cost
                results[name] = run(model, batch_ids, attn=attn, cache_config=config, new_tokens=args.new_tokens,
                                    beams=beams)
            ref = results["dynamic"]
            ref_seqs = ref["_sequences"]
            for name, r in results.items():
                seqs = r.pop("_sequences")
                r.update(variant=name, prompt=prompt, batch=batch_ids.shape[0], mode=mode,
                         tokens_identical=bool(torch.equal(seqs, ref_seqs)))
                if r["decode_step_s"] and ref["decode_step_s"]:
                    r["decode_speedup_vs_dynamic"] = ref["decode_step_s"] / r["decode_step_s"]
                r["wall_ratio_vs_dynamic"] = r["wall_s"] / ref["wall_s"]
                r["kv_ratio_vs_dynamic"] = r["kv_bytes"] / ref["kv_bytes"]
                rows.append(r)
                step = f"{1e3 * r['decode_step_s']:7.1f} ms" if r["decode_step_s"] else "    n/a   "
                reorder = f"{1e3 * r['reorder_s_per_step']:6.2f} ms" if r["reorder_s_per_step"] is not None else "   n/a   "
                print(f"prompt {prompt:5d} {mode:6s} {name:12s} step {step} wall {r['wall_s']:6.2f} s "
                      f"reorder/step {reorder} kv {r['kv_bytes'] / 2**20:7.1f} MiB "
                      f"speedup {r.get('decode_speedup_vs_dynamic', float('nan')):5.2f}x "
                      f"wall ratio {r['wall_ratio_vs_dynamic']:5.2f} identical {r['tokens_identical']}", flush=True)
    env = describe_environment(model)
    report = dict(
        benchmark="paged_cpu",
        command=env["command"],
        device=dict(kind="cpu", processor=env["processor"], cores=int(env["cpu_count"]),
                    torch_threads=int(env["torch_threads"]), platform=env["platform"]),
        versions={k: env[k] for k in ("python", "torch", "transformers", "hf_vkv")},
        model="SmolLM2-135M-Instruct (fp32)", new_tokens=args.new_tokens, results=rows,
    )
    write_report(args.json, report)
    return 0 if all(r["tokens_identical"] for r in rows) else 1


# ---------------------------------------- kernels (formerly benchmarks/paged_attention.py)
KERNELS_DOC = """Paged attention kernels against contiguous sdpa on the same K/V (decode: one query token a row).

For each (batch, context, block size) the K/V of every row is made once as contiguous
``[batch, kv_heads, context, head_dim]`` tensors, then scattered into a pool of blocks in a random
order (the paged view of the *same* values). Timed side by side:

* on CUDA (fp16): the Triton paged kernel (``paged_attention_triton``) vs
  ``F.scaled_dot_product_attention`` on the contiguous K/V (``enable_gqa``); the target is paged
  <= 1.10x contiguous. Timed with CUDA events, median of ``--iters`` calls after warm-up;
* on the CPU (fp32, one thread): the torch reference (``gather_kv`` copy + sdpa) vs sdpa on the
  contiguous K/V, and the gather alone, median of ``--iters`` calls (``time.perf_counter``).

Every run checks that the paged result matches the contiguous one (max abs difference in the JSON).
Shapes: Llama-3-8B's attention on CUDA (32 query heads, 8 kv heads, head_dim 128); SmolLM2-135M's on
the CPU (9 query heads, 3 kv heads, head_dim 64). Writes JSON with the device, library versions and
the exact command to ``benchmarks/results/paged_attention_<device>.json``.

    python benchmarks/paged_cpu.py kernels --device cpu --quick   # the committed CPU run (small grid)
    python benchmarks/paged_cpu.py kernels --device cuda          # batch 1/8/32 x 1k/4k/16k x blocks 16/64/256
"""


GRIDS = {
    # device: (batches, contexts, block sizes, (q_heads, kv_heads, head_dim), dtype)
    "cuda": ((1, 8, 32), (1024, 4096, 16384), (16, 64, 256), (32, 8, 128), torch.float16),
    "cpu": ((1, 8), (1024, 4096), (16, 64, 256), (9, 3, 64), torch.float32),
}
QUICK_CPU = ((1, 4), (1024, 4096), (16, 256))


def make_problem(batch: int, context: int, block_size: int, heads: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device, seed: int = 0):
    """Contiguous K/V ``[B, Hkv, S, D]``, the same values in a shuffled pool of blocks, a query."""
    q_heads, kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    keys = torch.randn(batch, kv_heads, context, head_dim, generator=gen, device=device, dtype=dtype)
    values = torch.randn(batch, kv_heads, context, head_dim, generator=gen, device=device, dtype=dtype)
    query = torch.randn(batch, q_heads, 1, head_dim, generator=gen, device=device, dtype=dtype)
    per_row = -(-context // block_size)
    padded = per_row * block_size
    order = torch.randperm(batch * per_row, generator=gen, device=device)
    tables = order.view(batch, per_row).to(torch.int32)  # row b's j-th block is pool block tables[b, j]
    pool_k = torch.zeros(batch * per_row, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    pool_v = torch.zeros_like(pool_k)
    # [B, Hkv, S, D] -> [B * per_row, block_size, Hkv, D] in table order, then scattered to the pool
    k_blocks = F.pad(keys, (0, 0, 0, padded - context)).transpose(1, 2).reshape(batch * per_row, block_size,
                                                                                   kv_heads, head_dim)
    v_blocks = F.pad(values, (0, 0, 0, padded - context)).transpose(1, 2).reshape(batch * per_row, block_size,
                                                                                     kv_heads, head_dim)
    pool_k[order.long()] = k_blocks
    pool_v[order.long()] = v_blocks
    return query, keys, values, pool_k, pool_v, tables


def time_cuda(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each between CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_cpu(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls (``time.perf_counter``)."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(device: torch.device, grid, iters: int) -> list[dict]:
    batches, contexts, blocks, heads, dtype = grid
    scale = heads[2] ** -0.5
    results = []
    for batch in batches:
        for context in contexts:
            for block_size in blocks:
                query, keys, values, pool_k, pool_v, tables = make_problem(batch, context, block_size, heads, dtype,
                                                                         device)
                kv = PagedKV(pool_k, pool_v, tables, 0, context)

                def contiguous():
                    return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)

                row = {"batch": batch, "context": context, "block_size": block_size, "dtype": str(dtype)}
                if device.type == "cuda":
                    from hf_vkv.attention.triton_paged import paged_attention_triton

                    def paged():
                        return paged_attention_triton(query, kv, scale=scale)

                    row["paged_kernel"] = "triton"
                    row["contiguous_ms"] = round(time_cuda(contiguous, iters), 4)
                    row["paged_ms"] = round(time_cuda(paged, iters), 4)
                else:
                    def paged():
                        return paged_attention_reference(query, kv, scale=scale)

                    row["paged_kernel"] = "reference (gather_kv + sdpa)"
                    row["contiguous_ms"] = round(time_cpu(contiguous, iters), 4)
                    row["paged_ms"] = round(time_cpu(paged, iters), 4)
                    row["gather_ms"] = round(time_cpu(lambda: gather_kv(kv), iters), 4)
                row["paged_over_contiguous"] = round(row["paged_ms"] / row["contiguous_ms"], 3)
                row["max_abs_diff"] = float((paged().float() - contiguous().float()).abs().max())
                results.append(row)
                print(f"batch {batch:>3} context {context:>6} block {block_size:>4}: contiguous "
                      f"{row['contiguous_ms']:9.3f} ms  paged {row['paged_ms']:9.3f} ms  "
                      f"ratio {row['paged_over_contiguous']:6.3f}  max|diff| {row['max_abs_diff']:.2e}", flush=True)
                del query, keys, values, pool_k, pool_v, tables
    return results


def main_kernels(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="paged_cpu.py kernels", description=KERNELS_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: Triton vs sdpa; cpu: reference vs sdpa (auto: cuda when present)")
    parser.add_argument("--quick", action="store_true", help="CPU only: a smaller grid (batch 1/4, blocks 16/256)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 50 GPU, 10 CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/paged_attention_<device>.json)")
    args = parser.parse_args(argv)
    device_type = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(device_type)
    grid = GRIDS[device_type]
    if args.quick and device_type == "cpu":
        grid = (*QUICK_CPU, *grid[3:])
    iters = args.iters or (50 if device_type == "cuda" else 10)
    if device_type == "cpu":
        torch.set_num_threads(1)  # a shared 2-core machine: one thread gives stable numbers

    load_before = os.getloadavg()  # the CPU timings are only as quiet as the machine was
    results = bench(device, grid, iters)
    env = describe_environment(device=device)
    report = {
        "benchmark": "paged_attention",
        "command": env["command"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": env["device"],
        "machine": {"platform": env["platform"], "cpu_count": int(env["cpu_count"]),
                    "load_average_1_5_15_min": {"before": [round(x, 2) for x in load_before],
                                                "after": [round(x, 2) for x in os.getloadavg()]}},
        "versions": {k: env[k] for k in ("python", "torch", "hf_vkv", "triton") if k in env},
        "torch_threads": int(env["torch_threads"]),
        "heads": dict(zip(("q_heads", "kv_heads", "head_dim"), grid[3])),
        "iters": iters,
        "results": results,
    }
    out = args.out or Path(__file__).parent / "results" / f"paged_attention_{device_type}.json"
    write_report(out, report)


# ---------------------------------------- profile: where a paged decode step's time goes on the CPU
PROFILE_DOC = """Contiguous vs paged decode on the CPU, interleaved, with what each step is spent on.

Batch ``--batch`` greedy on a ``--prompt``-token prompt (SmolLM2-135M fp32): per round one
generate() with the contiguous layout (sdpa) and one with the paged layout (``"vkv_paged"``,
``--block`` tokens a block), the median decode step of each over ``--rounds`` rounds (a round's
order alternates), tokens checked identical. Then one more generate of each with
``torch.profiler`` running over its decode steps (from the first token to the last): the operators
by self CPU time, so the step's extra time is named. JSON: ``benchmarks/results/paged_cpu_profile_t{threads}.json``.

    python benchmarks/paged_cpu.py profile --prompt 2048 --batch 4 --rounds 3 --threads 1
"""


def _profiled_ops(model, ids, *, attn: str, cache_config: dict, new_tokens: int, top: int) -> list[dict]:
    """The operators of the decode steps (the profiler runs from the first token to the last) by
    self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    from transformers.generation.streamers import BaseStreamer

    prof = profile(activities=[ProfilerActivity.CPU])

    class DecodeOnly(BaseStreamer):
        def __init__(self) -> None:
            self.puts = 0

        def put(self, value: torch.Tensor) -> None:  # the prompt first, then each new token
            self.puts += 1
            if self.puts == 2:
                prof.start()

        def end(self) -> None:
            prof.stop()

    model.set_attn_implementation(attn)
    try:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=DecodeOnly(),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=model.generation_config.eos_token_id, cache_implementation="vkv",
                           cache_config=cache_config)
    finally:
        model.set_attn_implementation("sdpa")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [dict(op=e.key, calls=e.count, self_cpu_s=e.self_cpu_time_total / 1e6,
                 share=e.self_cpu_time_total / total) for e in events[:top]]


def main_profile(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="paged_cpu.py profile", description=PROFILE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_default_model(dtype=torch.float32)
    ids = torch.randint(10, model.config.vocab_size, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(args.prompt))
    variants = {"contiguous": ("sdpa", {}), "paged": ("vkv_paged", {"block_tokens": args.block})}
    steps: dict[str, list[float]] = {name: [] for name in variants}
    sequences: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            attn, config = variants[name]
            out = run(model, ids, attn=attn, cache_config=config, new_tokens=args.new_tokens, beams=1)
            steps[name].append(out["decode_step_s"])
            sequences[name] = out["_sequences"]
            print(f"round {r} {name:10s} decode step {1e3 * out['decode_step_s']:.1f} ms", flush=True)
    median = {name: statistics.median(v) for name, v in steps.items()}
    ops = {name: _profiled_ops(model, ids, attn=attn, cache_config=config, new_tokens=args.new_tokens, top=args.top)
           for name, (attn, config) in variants.items()}
    for name, rows in ops.items():
        print(f"{name}: " + ", ".join(f"{o['op']} {100 * o['share']:.0f}%" for o in rows[:6]))
    env = describe_environment(model)
    report = dict(
        benchmark="paged_cpu_profile", command=env["command"], environment=env, model="SmolLM2-135M-Instruct (fp32)",
        prompt=args.prompt, batch=args.batch, block_tokens=args.block, new_tokens=args.new_tokens, rounds=args.rounds,
        decode_step_s=steps, median_decode_step_s=median,
        contiguous_over_paged=median["contiguous"] / median["paged"],
        tokens_identical=bool(torch.equal(sequences["contiguous"], sequences["paged"])), profiled_ops=ops)
    print(f"median step: contiguous {1e3 * median['contiguous']:.1f} ms, paged {1e3 * median['paged']:.1f} ms "
          f"(paged runs at {report['contiguous_over_paged']:.2f}x the contiguous speed); tokens identical "
          f"{report['tokens_identical']}")
    threads = torch.get_num_threads()
    write_report(args.json or Path(f"benchmarks/results/paged_cpu_profile_t{threads}.json"), report)
    return 0 if report["tokens_identical"] else 1


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"kernels": main_kernels, "profile": main_profile})


if __name__ == "__main__":
    raise SystemExit(main())

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
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from common import StepClock, write_report  # benchmarks/common.py
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.default_model import load_default_model


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    raise SystemExit(main())

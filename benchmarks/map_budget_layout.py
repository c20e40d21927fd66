"""Rows limited by memory, not by mappings: what the layout rule's mapping count rests on.

``choose_layout`` (``hf_vkv/devices.py``, rule 7) gives CPU rows token-major where head-major's
rows would need more kernel mappings (``vm.max_map_count``) than the process has free. Three
measurements back it:

``count`` — kernel mappings per row and per (layer, K/V, head) sub-row, each layout, counted with
``PROCESS_MAP_BUDGET.held`` at every step (the most seen), on a tiny 4-layer Llama with 4 KV heads
(32 sub-rows a row; float32, 4 KiB head-major pages of 64 tokens) over greedy, sampling and beams
(no model download; a few seconds)::

    python benchmarks/map_budget_layout.py count --json benchmarks/results/map_budget_count.json

``step`` — the decode step of each layout for ``n`` rows sampled from one shared prompt on the
embedded SmolLM2-135M (``generate(do_sample=True, num_return_sequences=n)``, prefill once as by
default), the layouts interleaved in rotated order over ``--rounds`` rounds, the median of each
run's median step (between two logits-processor calls); mappings held at the end, and whether the
layouts chose the same tokens (same seed: they must)::

    HF_HUB_OFFLINE=1 python benchmarks/map_budget_layout.py step --prompt 2048 --rows 64 \\
        --new-tokens 6 --rounds 3 --json benchmarks/results/map_budget_step_2048x64.json

``real`` — the case the rule is for, once, with default options (the layout the rule picks): wall
time, the layout, KV bytes and mappings held when generate returns::

    HF_HUB_OFFLINE=1 python benchmarks/map_budget_layout.py real --prompt 8192 --rows 128 \\
        --dtype bfloat16 --new-tokens 4 --json benchmarks/results/map_budget_real_8192x128_bf16.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_vkv  # noqa: F401  (registers "vkv")
from hf_vkv.ab.harness import describe_environment
from hf_vkv.memory.map_budget import PROCESS_MAP_BUDGET
from common import dispatch, write_report

LAYOUTS = ("head_major", "token_major")


class Marks(LogitsProcessor):
    """When ``generate`` calls it (once per step), and the most mappings vkv held at any call."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.peak = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        self.peak = max(self.peak, PROCESS_MAP_BUDGET.held)
        return scores

    def median_step(self) -> float | None:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return statistics.median(gaps) if gaps else None


def _generate(model: Any, ids: torch.Tensor, *, layout: str | None, seed: int, **kwargs: Any) -> dict[str, Any]:
    gc.collect()
    base = PROCESS_MAP_BUDGET.held
    marks = Marks()
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="vkv",
                         cache_config=None if layout is None else {"layout": layout}, pad_token_id=0,
                         logits_processor=LogitsProcessorList([marks]), return_dict_in_generate=True, **kwargs)
    wall = time.perf_counter() - start
    cache = out.past_key_values
    stats = cache.stats()  # (a checkout before CacheStats.mappings: mappings_end None)
    result = dict(layout=cache.layout, wall_s=wall, ttft_s=marks.times[0] - start if marks.times else None,
                  step_s=marks.median_step(), rows=ids.shape[0] * max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1)),
                  mappings_end=getattr(stats, "mappings", None), mappings_peak=marks.peak - base,
                  resident_bytes=stats.resident_bytes, token_bytes=stats.token_bytes,
                  process_mappings_limit=PROCESS_MAP_BUDGET.limit, vkv_mappings_held=PROCESS_MAP_BUDGET.held)
    return {"result": result, "sequences": out.sequences}


def _tiny(layers: int, kv_heads: int) -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         bos_token_id=2, eos_token_id=1, pad_token_id=0)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def count_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="map_budget_layout.py count", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    layers, kv_heads = 4, 4
    subrows = layers * 2 * kv_heads
    model = _tiny(layers, kv_heads)
    modes = {"greedy_b4": (4, dict(do_sample=False)),
             "sample_n8": (1, dict(do_sample=True, num_return_sequences=8)),
             "beam4": (1, dict(num_beams=4)), "beam8": (1, dict(num_beams=8))}
    rows_out = []
    for mode, (batch, kw) in modes.items():
        for prompt, new in ((20, 6), (100, 60), (130, 120)):
            ids = torch.randint(3, 512, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
            for layout in LAYOUTS:
                got = _generate(model, ids, layout=layout, seed=0, max_new_tokens=new, min_new_tokens=new, **kw)
                r = got["result"]
                per_row = r["mappings_peak"] / r["rows"]
                row = dict(mode=mode, prompt=prompt, new_tokens=new, layout=layout, rows=r["rows"],
                           peak_mappings=r["mappings_peak"], per_row=round(per_row, 2),
                           per_subrow=round(per_row / subrows, 2) if layout == "head_major" else None)
                rows_out.append(row)
                print(row)
    most = max(r["per_subrow"] for r in rows_out if r["per_subrow"] is not None)
    print(f"most per head-major sub-row: {most}; most per token-major row: "
          f"{max(r['per_row'] for r in rows_out if r['layout'] == 'token_major')}")
    if args.json:
        write_report(args.json, dict(model=f"tiny llama {layers} layers, {kv_heads} KV heads, fp32",
                                     subrows_per_row=subrows, cells=rows_out, most_per_subrow=most,
                                     environment=describe_environment(model)))
    return 0


def _smollm(dtype: str) -> Any:
    from hf_vkv.default_model import load_default_model

    loaded = load_default_model(dtype=getattr(torch, dtype))
    return loaded[0] if isinstance(loaded, tuple) else loaded


def step_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="map_budget_layout.py step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=(*LAYOUTS, "default"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _smollm(args.dtype)
    ids = torch.randint(10, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.layouts}
    sequences: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        order = args.layouts[r % len(args.layouts):] + args.layouts[:r % len(args.layouts)]
        for name in order:
            got = _generate(model, ids, layout=None if name == "default" else name, seed=1234,
                            do_sample=True, num_return_sequences=args.rows, max_new_tokens=args.new_tokens,
                            min_new_tokens=args.new_tokens)
            runs[name].append(got["result"])
            sequences.setdefault(name, got["sequences"])
            print(f"round {r} {name}: {got['result']}", flush=True)
    first = next(iter(sequences.values()))
    same = all(torch.equal(first, s) for s in sequences.values())
    summary = {name: dict(step_s_median=statistics.median(x["step_s"] for x in rs),
                          step_s_rounds=[x["step_s"] for x in rs], ttft_s_median=statistics.median(x["ttft_s"] for x in rs),
                          mappings_end=rs[-1]["mappings_end"], mappings_peak=max(x["mappings_peak"] for x in rs),
                          layout=rs[-1]["layout"]) for name, rs in runs.items()}
    if "head_major" in summary and "token_major" in summary:
        ratios = [t["step_s"] / h["step_s"] for h, t in zip(runs["head_major"], runs["token_major"])]
        summary["token_major_over_head_major_step"] = dict(median=statistics.median(ratios), rounds=ratios)
    summary["same_tokens"] = same
    for key, value in summary.items():
        print(key, value)
    if args.json:
        write_report(args.json, dict(prompt=args.prompt, rows=args.rows, new_tokens=args.new_tokens,
                                     rounds=args.rounds, dtype=args.dtype, threads=torch.get_num_threads(),
                                     summary=summary, runs=runs, environment=describe_environment(model)))
    return 0 if same else 1


def real_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="map_budget_layout.py real", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = _smollm(args.dtype)
    ids = torch.randint(10, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    got = _generate(model, ids, layout=None, seed=1234, do_sample=True, num_return_sequences=args.rows,
                    max_new_tokens=args.new_tokens)
    result = got["result"]
    print(result)
    if args.json:
        write_report(args.json, dict(prompt=args.prompt, rows=args.rows, new_tokens=args.new_tokens,
                                     dtype=args.dtype, threads=torch.get_num_threads(), result=result,
                                     environment=describe_environment(model)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return dispatch(argv, lambda rest: count_main(rest), {"count": count_main, "step": step_main, "real": real_main})


if __name__ == "__main__":
    sys.exit(main())

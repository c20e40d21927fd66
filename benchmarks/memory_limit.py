"""KV memory at the physical limit: what vkv holds, with default options, against the limit and
against DynamicCache, for rows that share a prompt.

n rows sharing a P-token prompt and generating G tokens each need, stored once, (P + n G)
tokens of K/V (the *limit*); a DynamicCache holds n (P + G). Per grid point (n sampled rows,
``generate(do_sample=True, num_return_sequences=n)``, or n beams, ``num_beams=n``; a prompt of P
random tokens; ``max_new_tokens = min_new_tokens = G``) this runs ``generate`` with
``cache_implementation="vkv"`` and no ``cache_config`` on the embedded SmolLM2-135M, and records
the layout ``choose_layout`` picked, its page size, the KV bytes the cache holds when generate
returns (``cache.stats().resident_bytes``: the memfd pages its rows hold, a shared page once), the
limit and DynamicCache's bytes (from the model's shape: ``hf_vkv.ab.probes.kv_bytes_per_token``;
DynamicCache is not run) and both ratios. Points estimated to take over ``--max-seconds`` on this
machine are skipped, each with its reason in the JSON. Exit status 1 when a point measured breaks
a bound (over ``1 + MEMORY_LIMIT_SLACK`` times the limit with P >= 512, or over DynamicCache's; rule 6
leaves some such points to head-major, whose step is faster: docs/layouts.md#memory-at-the-limit).

    HF_HUB_OFFLINE=1 python benchmarks/memory_limit.py --new-tokens 5 --prompts 128 512 2048 \\
        --rows 1 2 4 8 16 32 64 --beams 2 4 8 --json benchmarks/results/memory_limit_g5.json

``--layout head_major`` / ``--layout token_major``: the same points with that layout forced
(``memory_limit_g5_head_major.json``, ``memory_limit_g5_token_major.json``).

``layout-cost``: what the rule's choice costs in time where it moves a workload (``layout-cost
--help``): time to first token and decode step of generate(), head-major against token-major
forced by ``cache_config``, interleaved in one process, with each layout's KV bytes::

    HF_HUB_OFFLINE=1 python benchmarks/memory_limit.py layout-cost --threads 1 2 --rounds 3 \\
        --cells sample8@2048 greedy@512 greedy@2048 --json benchmarks/results/memory_limit_layout_cost.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hf_vkv  # noqa: F401  (registers "vkv")
from hf_vkv import devices
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.probes import kv_bytes_per_token
from hf_vkv.default_model import load_default_model
from common import StepMarks, dispatch, write_report

SAMPLE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BEAMS = (2, 4, 8, 16)
PROMPTS = (5, 128, 512, 2048, 8192)


def _page_bytes(cache: Any) -> int | None:
    sizes = {arena.backend.page_bytes for arena in cache._arenas.values()}  # noqa: SLF001
    return sizes.pop() if len(sizes) == 1 else None


def measure(model: Any, *, mode: str, n: int, prompt: int, new: int, layout: str | None = None) -> dict[str, Any]:
    bpt = kv_bytes_per_token(model)
    ids = torch.randint(10, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    kwargs = dict(do_sample=True, num_return_sequences=n) if mode == "sample" else \
        dict(num_beams=n, do_sample=False, early_stopping=False, length_penalty=0.0)
    gc.collect()
    torch.manual_seed(0)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         cache_implementation="vkv", pad_token_id=0, return_dict_in_generate=True,
                         cache_config=None if layout is None else {"layout": layout}, **kwargs)
    seconds = time.perf_counter() - start
    cache = out.past_key_values
    stats = cache.stats()
    limit = (prompt + n * new) * bpt
    dynamic = n * (prompt + new) * bpt
    point = dict(n=n, mode=mode, P=prompt, G=new, layout=cache.layout, page_bytes=_page_bytes(cache),
                 vkv_bytes=stats.resident_bytes, token_bytes=stats.token_bytes, limit_bytes=limit,
                 dynamic_bytes=dynamic, over_limit=stats.resident_bytes / limit,
                 over_dynamic=stats.resident_bytes / dynamic, cached_tokens=cache.get_seq_length(),
                 mappings=stats.mappings, seconds=round(seconds, 2))
    point["meets"] = point["over_dynamic"] <= 1.0 and (prompt < 512 or point["over_limit"] <= 1 + devices.MEMORY_LIMIT_SLACK)
    del out, cache
    gc.collect()
    return point


def estimate_seconds(mode: str, n: int, prompt: int, new: int) -> float:
    """A rough wall time on 2 shared cores (SmolLM2 fp32: ~2 s a decode step at 64 rows x 128
    tokens, ~25 s to prefill 8k tokens, attention ~n x P)."""
    prefill = prompt * prompt / 2.7e6 + prompt / 400
    step = 0.03 * n + n * prompt / 4e5
    return prefill + new * step


def default_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS))
    parser.add_argument("--rows", type=int, nargs="+", default=list(SAMPLE_ROWS))
    parser.add_argument("--beams", type=int, nargs="+", default=list(BEAMS))
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--layout", default=None, help="cache_config['layout'] (default: none, the rule's choice)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/memory_limit_g5.json"))
    parser.add_argument("--append", action="store_true", help="add to the points already in --json")
    args = parser.parse_args(argv)
    model = load_default_model(dtype=getattr(torch, args.dtype))
    model = model[0] if isinstance(model, tuple) else model
    points: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    grid = [("sample", n) for n in args.rows] + [("beam", n) for n in args.beams]
    for prompt in args.prompts:
        for mode, n in grid:
            guess = estimate_seconds(mode, n, prompt, args.new_tokens)
            if guess > args.max_seconds:
                skipped.append(dict(n=n, mode=mode, P=prompt, G=args.new_tokens, dtype=args.dtype,
                                    reason=f"estimated {guess:.0f} s > {args.max_seconds:.0f} s on this machine"))
                continue
            point = measure(model, mode=mode, n=n, prompt=prompt, new=args.new_tokens, layout=args.layout)
            point["dtype"] = args.dtype
            point["asked_layout"] = args.layout
            points.append(point)
            print(json.dumps(point), flush=True)
    command = "python " + " ".join([sys.argv[0], *argv])
    report = dict(benchmark="memory_limit", slack=devices.MEMORY_LIMIT_SLACK,
                  kv_bytes_per_token={args.dtype: kv_bytes_per_token(model)},
                  environment={args.dtype: describe_environment(model, command=command)},
                  points=points, skipped=skipped)
    if args.append and args.json.exists():
        old = json.loads(args.json.read_text())
        report["points"] = old["points"] + points
        report["skipped"] = old["skipped"] + skipped
        report["kv_bytes_per_token"] = {**old["kv_bytes_per_token"], **report["kv_bytes_per_token"]}
        report["environment"] = {**old["environment"], **report["environment"]}
    measured = {(p["dtype"], p["mode"], p["n"], p["P"]) for p in report["points"]}
    report["skipped"] = [s for s in report["skipped"] if (s["dtype"], s["mode"], s["n"], s["P"]) not in measured]
    write_report(args.json, report)
    bad = [p for p in points if not p["meets"]]
    for p in bad:
        print(f"MISSES: {p}", file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------------------- layout-cost
LAYOUT_COST_DOC = """What rule 6's choice costs in time: per cell (a workload of hf_vkv.ab.bench.mode_kwargs,
``greedy``, ``sampleN`` or ``beamN``, at a prompt of P random tokens, written ``workload@P``) and
per intra-op thread count, one generate() of 1 + --decode-steps new tokens (min_new_tokens the
same) per layout per round with ``cache_implementation="vkv"`` and ``cache_config={"layout": L}``,
L head-major and token-major, the order alternating by round, the median of --rounds rounds.
TTFT: from the generate() call to the first logits processor call (set-up, prefill, output head);
decode step: the median gap between two logits processor calls of the run. Each cell first runs
one untimed generate with no cache_config, which records the layout choose_layout gives it (the
default), and per thread count one untimed generate per layout. KV: ``stats().resident_bytes`` when generate returns, against the limit (P + n G tokens)
and DynamicCache's n (P + G). Checks: every round's sequences and logits of the two layouts
torch.equal, and against one DynamicCache generate per cell and thread count where rows x P <= --dynamic-max-tokens
(exit status 1 on any difference).

    HF_HUB_OFFLINE=1 python benchmarks/memory_limit.py layout-cost --threads 1 2 --rounds 3 \\
        --cells sample8@2048 greedy@512 greedy@2048 --json benchmarks/results/memory_limit_layout_cost.json
"""

LAYOUTS = ("head_major", "token_major")


def _parse_cell(text: str) -> tuple[str, int]:
    workload, _, prompt = text.partition("@")
    from hf_vkv.ab.bench import mode_kwargs

    mode_kwargs(workload)  # ValueError naming it
    return workload, int(prompt)


def _timed_generate(model: Any, ids: torch.Tensor, workload: str, *, new: int, seed: int,
                    cache_config: dict[str, Any] | None, dynamic: bool = False) -> dict[str, Any]:
    from hf_vkv.ab.bench import mode_kwargs
    from transformers import LogitsProcessorList

    marks = StepMarks()
    extra: dict[str, Any] = {} if dynamic else dict(cache_implementation="vkv", cache_config=cache_config)
    gc.collect()
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         pad_token_id=0, logits_processor=LogitsProcessorList([marks]), output_logits=True,
                         return_dict_in_generate=True, **extra, **mode_kwargs(workload))
    run: dict[str, Any] = dict(ttft_s=marks.times[0] - start, step_s=marks.median_step() if len(marks.times) > 2 else None,
                               sequences=out.sequences, logits=[x.clone() for x in out.logits])
    if not dynamic:
        cache = out.past_key_values
        stats = cache.stats()
        run.update(layout=cache.layout, page_bytes=_page_bytes(cache), kv_bytes=stats.resident_bytes,
                   mappings=stats.mappings)
        cache.close()
    del out
    return run


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["sequences"].shape == b["sequences"].shape and torch.equal(a["sequences"], b["sequences"]) and \
        len(a["logits"]) == len(b["logits"]) and all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"]))


def main_layout_cost(argv: list[str]) -> int:
    import statistics

    from hf_vkv.ab.bench import mode_kwargs

    parser = argparse.ArgumentParser(prog="memory_limit.py layout-cost", description=LAYOUT_COST_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", type=_parse_cell, default=[("sample8", 2048), ("greedy", 512), ("greedy", 2048)])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dynamic-max-tokens", type=int, default=16384,
                        help="run the DynamicCache reference only where rows x prompt <= this")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/memory_limit_layout_cost.json"))
    args = parser.parse_args(argv)
    model = load_default_model(dtype=getattr(torch, args.dtype))[0]
    bpt = kv_bytes_per_token(model)
    new = 1 + args.decode_steps
    cells, failures = [], 0
    for workload, prompt in args.cells:
        kwargs = mode_kwargs(workload)
        rows = max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
        ids = torch.randint(10, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        default = _timed_generate(model, ids, workload, new=2, seed=args.seed, cache_config=None)
        for threads in args.threads:
            torch.set_num_threads(threads)
            reference = None  # at the same thread count: another count may round differently
            if rows * prompt <= args.dynamic_max_tokens:
                reference = _timed_generate(model, ids, workload, new=new, seed=args.seed, cache_config=None,
                                            dynamic=True)
            for layout in LAYOUTS:  # untimed: first-call costs (prefill once's proofs are made per thread count)
                _timed_generate(model, ids, workload, new=2, seed=args.seed, cache_config={"layout": layout})
            runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
            identical = True
            for r in range(args.rounds):
                order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
                this = {layout: _timed_generate(model, ids, workload, new=new, seed=args.seed,
                                                cache_config={"layout": layout}) for layout in order}
                identical &= _same(this["head_major"], this["token_major"])
                if reference is not None:
                    identical &= _same(this["head_major"], reference)
                for layout in LAYOUTS:
                    run = this[layout]
                    run.pop("sequences"), run.pop("logits")
                    runs[layout].append(run)
            failures += not identical
            cell: dict[str, Any] = dict(workload=workload, prompt=prompt, rows=rows, new_tokens=new, threads=threads,
                                        default_layout=default["layout"], tokens_identical=identical,
                                        dynamic_reference=reference is not None,
                                        limit_bytes=(prompt + rows * new) * bpt, dynamic_bytes=rows * (prompt + new) * bpt)
            for layout in LAYOUTS:
                rs = runs[layout]
                cell[layout] = dict(ttft_s=statistics.median(x["ttft_s"] for x in rs),
                                    step_s=statistics.median(x["step_s"] for x in rs),
                                    kv_bytes=rs[-1]["kv_bytes"], page_bytes=rs[-1]["page_bytes"], mappings=rs[-1]["mappings"],
                                    over_limit=rs[-1]["kv_bytes"] / cell["limit_bytes"],
                                    over_dynamic=rs[-1]["kv_bytes"] / cell["dynamic_bytes"],
                                    rounds=[{k: v for k, v in x.items() if k in ("ttft_s", "step_s", "kv_bytes")} for x in rs])
            per_round = list(zip(runs["token_major"], runs["head_major"]))
            cell["token_over_head_ttft"] = statistics.median(t["ttft_s"] / h["ttft_s"] for t, h in per_round)
            cell["token_over_head_step"] = statistics.median(t["step_s"] / h["step_s"] for t, h in per_round)
            cells.append(cell)
            print(json.dumps({k: v for k, v in cell.items() if k not in LAYOUTS} |
                             {f"{layout}_{k}": round(cell[layout][k], 4) for layout in LAYOUTS
                              for k in ("ttft_s", "step_s", "over_limit", "over_dynamic")}), flush=True)
    command = "python " + " ".join([sys.argv[0], "layout-cost", *argv])
    environment = describe_environment(model, command=command)
    environment["load_average_at_end"] = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    write_report(args.json, dict(benchmark="memory_limit_layout_cost", method=LAYOUT_COST_DOC.split("\n\n")[0],
                                 kv_bytes_per_token=bpt, environment=environment, cells=cells))
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    return dispatch(argv, default_main, {"layout-cost": main_layout_cost})


if __name__ == "__main__":
    sys.exit(main())

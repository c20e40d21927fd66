"""Short-prompt beam search by layout: DynamicCache, vkv head-major, vkv token-major.

``generate(num_beams=B)`` on the embedded SmolLM2-135M (fp32, CPU, ``--threads`` intra-op threads)
from the demo's short prompt (45 tokens with the chat template, or ``--prompt-tokens`` random ids),
the caches interleaved in rotated order over ``--rounds`` rounds; per cache the median decode step
(between two logits-processor calls) and wall time, the
KV bytes it holds when generate returns (``hf_vkv.ab.probes.kv_bytes``: vkv's resident pages, a
shared page once) and whether its tokens equal DynamicCache's. Writes JSON with the device,
versions and the exact command.

    python benchmarks/beam_layout_cpu.py --rounds 4 --json benchmarks/results/beam_layout_cpu.json

``profile``: where a 4-beam decode step goes, per cache (DynamicCache, vkv, vkv with
``"vkv_cascade"``, the ideal cache) under ``torch.profiler`` (``profile --help``)::

    python benchmarks/beam_layout_cpu.py profile --prompt 2048 --threads 1 \\
        --json benchmarks/results/profile_beam_step_2048_t1.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList, DynamicCache, LogitsProcessor

import hf_vkv  # noqa: F401  (registers "vkv")
from hf_vkv.ab.demo import encode_prompt
from hf_vkv.ab.demo_text import SHORT_PROMPT
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.ideal import IdealCache
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.default_model import load_default_model
from hf_vkv.generate import cache_kwarg
from common import StepMarks, dispatch, ideal_beam_cache, write_report


CACHES = {"dynamic": {}, "head_major": {"layout": "head_major"}, "token_major": {"layout": "token_major"}}


def run(model: torch.nn.Module, inputs: dict, name: str, *, beams: int, new_tokens: int
        ) -> tuple[float, float, int, torch.Tensor]:
    """One generate(): seconds, median decode step seconds, KV bytes held at the end, the sequences."""
    extra = {} if name == "dynamic" else {"cache_implementation": "vkv", "cache_config": CACHES[name]}
    marks = StepMarks()
    start = time.perf_counter()
    out = model.generate(**inputs, num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([marks]), **extra)
    wall = time.perf_counter() - start
    return wall, marks.median_step(), kv_bytes(out[cache_kwarg()]), out.sequences


def default_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="random ids instead of the demo's prompt")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_default_model(dtype=torch.float32)
    if args.prompt_tokens:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, model.config.vocab_size, (1, args.prompt_tokens), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        inputs = encode_prompt(tok, SHORT_PROMPT)
    prompt = inputs["input_ids"].shape[1]
    names = list(CACHES)
    with torch.inference_mode():
        run(model, inputs, "dynamic", beams=args.beams, new_tokens=2)  # warm-up, untimed
        walls: dict[str, list[float]] = {n: [] for n in names}
        steps: dict[str, list[float]] = {n: [] for n in names}
        kv: dict[str, int] = {}
        seqs: dict[str, torch.Tensor] = {}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                wall, step, held, seq = run(model, inputs, name, beams=args.beams, new_tokens=args.new_tokens)
                walls[name].append(wall)
                steps[name].append(step)
                kv[name], seqs[name] = held, seq
    ref = walls["dynamic"]
    results = {}
    print(f"prompt {prompt} tokens, {args.beams} beams, {args.new_tokens} new tokens, {args.threads} threads, "
          f"{args.rounds} rounds")
    for name in names:
        ratios = [w / d for w, d in zip(walls[name], ref)]
        step_ratios = [a / d for a, d in zip(steps[name], steps["dynamic"])]
        results[name] = {"wall_s": walls[name], "median_wall_s": statistics.median(walls[name]),
                         "step_ms": [s * 1e3 for s in steps[name]], "median_step_ms": statistics.median(steps[name]) * 1e3,
                         "median_step_ratio_to_dynamic": statistics.median(step_ratios),
                         "median_ratio_to_dynamic": statistics.median(ratios), "kv_bytes": kv[name],
                         "kv_ratio_to_dynamic": kv[name] / kv["dynamic"],
                         "tokens_equal_dynamic": bool(torch.equal(seqs[name], seqs["dynamic"]))}
        print(f"{name:12s} step {statistics.median(steps[name]) * 1e3:.1f} ms (x{statistics.median(step_ratios):.3f}) "
              f"wall {statistics.median(walls[name]):.2f} s (x{statistics.median(ratios):.3f}; rounds "
              f"{' '.join(f'{w:.2f}' for w in walls[name])}), KV {kv[name] / 2**20:.2f} MiB "
              f"(x{kv[name] / kv['dynamic']:.2f}), tokens {'equal' if results[name]['tokens_equal_dynamic'] else 'DIFFER'}")
    if args.json:
        write_report(args.json, {"prompt_tokens": prompt, "beams": args.beams, "new_tokens": args.new_tokens,
                                 "rounds": args.rounds, "threads": args.threads, "results": results,
                                 "method": "one generate() per cache per round (min_new_tokens = max_new_tokens), "
                                 "caches interleaved, rotated by round; decode step = median time between two "
                                 "logits-processor calls of a run, then the median over rounds",
                                 "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


# ---------------------------------------- profile (formerly benchmarks/profile_beam_step.py)
PROFILE_DOC = """Where a 4-beam decode step spends its time, per cache: ``torch.profiler`` over the decode steps
of one ``generate`` for DynamicCache, vkv (sdpa), vkv with ``"vkv_cascade"`` and the ideal cache.

On the embedded SmolLM2-135M (fp32), ``--threads`` intra-op threads. Each cache runs one warm-up
``generate`` and one profiled one; the profiler starts at the second logits-processor call (after
the prefill and the first decode step) and stops at the last, so it covers ``--steps`` whole decode
steps (token choice, cache reorder, forward). Per step it reports the wall time and the profiled
time by part: the linear layers (``aten::mm``/``aten::addmm``, input rows x weights), attention
(sdpa's kernel, or the cascade's), the cache's ``update`` and ``reorder_cache`` (each wrapped in a
``record_function``, everything they run included), and the rest; and the top operators by self time.
The profiler's own cost inflates every part (most the many small calls); compare parts across
caches, and take step times from ``benchmarks/shared_prompt.py``.

    python benchmarks/beam_layout_cpu.py profile --prompt 64 --threads 1 \\
        --json benchmarks/results/profile_beam_step_64_t1.json
"""


PROFILED_CACHES = ("dynamic", "vkv", "vkv_cascade", "ideal")
#: The parts of a step: operator name -> part (record_function labels are this script's wrappers)
PARTS = {"aten::mm": "linear", "aten::addmm": "linear", "aten::scaled_dot_product_attention": "attention",
         "vkv_cascade_attention": "attention", "cache.update": "cache update", "cache.reorder_cache": "cache reorder"}


class ProfiledSteps(LogitsProcessor):
    """Starts a profiler at its second call and stops it at call ``last``."""

    def __init__(self, last: int) -> None:
        self.calls, self.last = 0, last
        self.profiler: torch.profiler.profile | None = None
        self.started = self.stopped = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += 1
        if self.calls == 2:
            self.profiler = torch.profiler.profile()
            self.profiler.start()
            self.started = time.perf_counter()
        elif self.calls == self.last and self.profiler is not None:
            self.stopped = time.perf_counter()
            self.profiler.stop()
        return scores


@contextlib.contextmanager
def labelled(classes: tuple[type, ...]) -> Iterator[None]:
    """``update`` and ``reorder_cache`` of ``classes`` run_profiled inside ``record_function`` labels."""
    saved = []
    for cls in classes:
        for name in ("update", "reorder_cache"):
            original = getattr(cls, name)  # its own or inherited (DynamicCache's come from Cache)

            def wrapped(self: Any, *args: Any, __original: Any = original, __label: str = f"cache.{name}",
                        **kwargs: Any) -> Any:
                with torch.profiler.record_function(__label):
                    return __original(self, *args, **kwargs)

            saved.append((cls, name, cls.__dict__.get(name)))
            setattr(cls, name, wrapped)
    try:
        yield
    finally:
        for cls, name, own in reversed(saved):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


def run_profiled(model: Any, ids: torch.Tensor, name: str, steps: int) -> ProfiledSteps:
    """One 4-beam generate of ``1 + steps + 1`` new tokens into cache ``name``, its decode steps
    profiled (the ideal cache is preloaded with the prompt, as in ``hf_vkv.ab.shared_prompt``)."""
    new = steps + 2
    probe = ProfiledSteps(last=steps + 2)
    kwargs = dict(num_beams=4, do_sample=False)
    cache: Any
    previous = model.config._attn_implementation
    if name == "vkv_cascade":  # before the cache is built: it tags shared prefixes for the attention it is built for
        model.set_attn_implementation("vkv_cascade")
    if name == "ideal":
        cache = ideal_beam_cache(model, ids, beams=4, new=new)
    elif name == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = hf_vkv.VKVCache.for_generate(model, batch_size=1, expand=4, max_length=ids.shape[1] + new + 1,
                                             cache_config=None)
    gc.collect()
    try:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(): cache}, max_new_tokens=new,
                           min_new_tokens=new, logits_processor=LogitsProcessorList([probe]), **kwargs)
    finally:
        model.set_attn_implementation(previous)
        if name not in ("ideal", "dynamic"):
            cache.close()
    return probe


def summarize(probe: ProfiledSteps, steps: int, top: int) -> dict[str, Any]:
    """Per-step milliseconds by part, and the top operators by self time."""
    assert probe.profiler is not None
    events = probe.profiler.key_averages()
    per_step = {"wall": (probe.stopped - probe.started) * 1e3 / steps}
    parts: dict[str, float] = {}
    labelled_attention = any(e.key == "vkv_cascade_attention" for e in events)
    for event in events:
        part = PARTS.get(event.key)
        if part is None or (labelled_attention and event.key == "aten::scaled_dot_product_attention"):
            continue  # under "vkv_cascade" sdpa runs inside the labelled attention: counted once
        parts[part] = parts.get(part, 0.0) + event.cpu_time_total / 1e3 / steps
    total_self = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    per_step.update({k: round(v, 2) for k, v in sorted(parts.items())})
    per_step["profiled_ops_self_total"] = round(total_self, 2)
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"ms_per_step": per_step,
            "top_ops_self_ms_per_step": {e.key: [round(e.self_cpu_time_total / 1e3 / steps, 3), e.count // steps]
                                         for e in ops}}


def main_profile(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="beam_layout_cpu.py profile", description=PROFILE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--caches", nargs="+", choices=PROFILED_CACHES, default=list(PROFILED_CACHES))
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_default_model()[0]
    ids = torch.randint(100, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(args.prompt))
    classes = (DynamicCache, IdealCache, hf_vkv.VKVCache)
    out: dict[str, Any] = {}
    with labelled(classes), attention_labelled():
        for name in args.caches:  # warm-up: every cache once before any is profiled
            run_profiled(model, ids, name, 2)
        for name in args.caches:
            out[name] = summarize(run_profiled(model, ids, name, args.steps), args.steps, args.top)
            print(name, out[name]["ms_per_step"], flush=True)
    if args.json:
        write_report(Path(args.json), {
            "benchmark": "profile_beam_step", "prompt": args.prompt, "beams": 4, "steps": args.steps,
            "threads": args.threads, "caches": out,
            "method": "torch.profiler over decode steps 2..steps+1 of one 4-beam generate per cache (after a warm-up "
                      "generate of each); ms per step by part (cpu total of aten::mm/addmm = linear, sdpa or "
                      "vkv_cascade_attention = attention, record_function around cache update / reorder_cache), "
                      "and top operators by self time [ms per step, calls per step]; profiler overhead included",
            "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


@contextlib.contextmanager
def attention_labelled() -> Iterator[None]:
    """The cascade attention runs inside a ``vkv_cascade_attention`` label (sdpa has its aten op)."""
    from transformers import AttentionInterface

    real = AttentionInterface._global_mapping["vkv_cascade"]

    def labelled_attention(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function("vkv_cascade_attention"):
            return real(*args, **kwargs)

    AttentionInterface._global_mapping["vkv_cascade"] = labelled_attention
    try:
        yield
    finally:
        AttentionInterface._global_mapping["vkv_cascade"] = real


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"profile": main_profile})


if __name__ == "__main__":
    raise SystemExit(main())

"""The benchmark of ``hf-vkv bench`` and ``benchmarks/generate_cpu.py`` (one code path for both).

Two parts, over a grid of prompt lengths x batches:

* **decode cells** (every point): ms per decode step of DynamicCache, the ideal cache
  (:mod:`.ideal`) and each vkv layout, measured as :mod:`.decode` says (prompt prefilled once,
  loaded into every cache through its ``update()``, decode steps interleaved, median of
  ``rounds`` rounds, argmax checked against DynamicCache at every step), with each cache's KV
  bytes and the vkv caches' ``stats().utilization``;
* **generate modes** (optional, ``modes``): one :func:`~hf_vkv.ab.run_ab` per point and mode
  (greedy, 4 beams, n=8 sampling; beams and sampling only for batches <= 4), DynamicCache against
  the default vkv cache through ``generate()``: identical tokens and logits, peak KV bytes.

Prompts are random ids drawn from a generator seeded by ``(prompt, batch)``, clear of the
special tokens at the start of the vocabulary. :func:`bench_report` wraps the results with the
environment (:func:`~hf_vkv.ab.harness.describe_environment`), the grid and the exact command.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from .decode import CacheTiming, load_prompt, prefill, time_decode
from .harness import run_ab
from .ideal import IdealCache
from .probes import kv_bytes
from ..memory.errors import ArgumentError

__all__ = [
    "BENCH_SCHEMA_VERSION", "CACHES", "DEFAULT_CACHES", "FULL_GRID", "MODES", "QUICK_GRID", "mode_kwargs", "VKV_LAYOUTS", "Grid",
    "all_identical", "bench_report", "cache_kv_bytes", "default_layout", "format_cells", "format_modes", "make_cache",
    "prompt_ids", "run_cells", "run_modes", "vkv_cache_config",
]

BENCH_SCHEMA_VERSION = "hf_vkv.bench/2"

#: Generation arguments of each ``generate()`` mode.
MODES: dict[str, dict[str, Any]] = {
    "greedy": dict(do_sample=False),
    "beam4": dict(do_sample=False, num_beams=4),
    "sample8": dict(do_sample=True, num_return_sequences=8, top_k=0, top_p=1.0, temperature=1.0),
}


def mode_kwargs(name: str) -> dict[str, Any]:
    """Generation arguments of a mode: one of :data:`MODES`, or ``beamN`` (N >= 2 beams) /
    ``sampleN`` (N >= 2 sampled rows), as the scaling grid names them. ``ValueError`` otherwise."""
    if name in MODES:
        return MODES[name]
    for prefix, make in (("beam", lambda n: dict(do_sample=False, num_beams=n)),
                         ("sample", lambda n: dict(MODES["sample8"], num_return_sequences=n))):
        rest = name[len(prefix):]
        if name.startswith(prefix) and rest.isdigit() and int(rest) >= 2 and rest == str(int(rest)):
            return make(int(rest))
    raise ArgumentError(f"unknown mode {name!r}: one of {sorted(MODES)}, or beamN / sampleN with N >= 2")

# ------------------------------------------------------------------------------------ layouts
#: The vkv layouts the decode cells can compare (CPU, contiguous: read by any attention).
VKV_LAYOUTS = ("token_major", "head_major", "per_layer")
#: The one place that spells a layout as ``cache_config`` (per-layer: token-major, a group per layer).
_LAYOUT_CONFIG: dict[str, dict[str, Any]] = {
    "token_major": {"layout": "token_major"},
    "head_major": {"layout": "head_major"},
    "per_layer": {"layout": "token_major", "groups": "layer"},
}


def vkv_cache_config(layout: str) -> dict[str, Any]:
    """The ``cache_config`` that selects ``layout`` (one of :data:`VKV_LAYOUTS`)."""
    try:
        return dict(_LAYOUT_CONFIG[layout])
    except KeyError:
        raise ArgumentError(f"unknown vkv layout {layout!r}; known: {list(VKV_LAYOUTS)}") from None


def default_layout(device: torch.device | str = "cpu") -> str:
    """The layout a VKVCache gets on ``device`` when ``cache_config`` names none."""
    from ..devices import policy_for

    return policy_for(device).layout


# ------------------------------------------------------------------------------------- caches
#: Every cache a decode cell can time.
CACHES = ("dynamic", "ideal", *VKV_LAYOUTS)
#: The caches timed unless told otherwise (per-layer is the slowest layout and no candidate).
DEFAULT_CACHES = ("dynamic", "ideal", "token_major", "head_major")


def make_cache(name: str, model: PreTrainedModel, batch: int, capacity: int) -> Cache:
    """A fresh cache ``name`` (one of :data:`CACHES`) for ``batch`` rows of ``capacity`` tokens."""
    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "ideal":
        return IdealCache(model.config, capacity=capacity)
    from ..cache import VKVCache

    return VKVCache.for_generate(model, batch_size=batch, expand=1, max_length=capacity,
                                 cache_config={**vkv_cache_config(name), "max_tokens": capacity})


def cache_kv_bytes(cache: Cache) -> int:
    """KV bytes a cache holds: the ideal cache's whole buffers, vkv's resident pages, the others'
    tensors."""
    return cache.nbytes() if isinstance(cache, IdealCache) else kv_bytes(cache)


def _vkv_numbers(cache: Cache) -> dict[str, float]:
    stats = cache.stats()  # type: ignore[attr-defined]
    return {"utilization": stats.utilization, "token_bytes": float(stats.token_bytes)}


# --------------------------------------------------------------------------------------- grid
@dataclass(frozen=True, slots=True, kw_only=True)
class Grid:
    """What to run: a decode cell per prompt length x batch, and ``modes`` generate A/B runs there.

    ``distinct_tokens`` bounds the prefill: a cell's batch holds ``max(1, distinct_tokens //
    prompt)`` distinct prompts (at most ``batch``), repeated over its rows. ``threads`` is the
    intra-op thread count of the timed decode steps (prefill uses torch's setting).
    """

    prompt_lengths: tuple[int, ...]
    batches: tuple[int, ...]
    new_tokens: int = 24
    rounds: int = 3
    caches: tuple[str, ...] = DEFAULT_CACHES
    modes: tuple[str, ...] = ()
    distinct_tokens: int = 8192
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("prompt_lengths", "batches"):
            values = getattr(self, name)
            if not values or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in values):
                raise ArgumentError(f"{name} must be positive ints, got {values!r}")
        for name, low in (("new_tokens", 2), ("rounds", 1), ("distinct_tokens", 1), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        for name, known in (("caches", CACHES), ("modes", tuple(MODES))):
            unknown = sorted(set(getattr(self, name)) - set(known))
            if unknown:
                raise ArgumentError(f"{name} must be some of {list(known)}, got {list(getattr(self, name))!r}")
        if "dynamic" not in self.caches:
            raise ArgumentError("caches must include 'dynamic' (the reference every step is checked against)")

    def cells(self) -> list[tuple[int, int]]:
        """``(prompt_length, batch)`` in run order."""
        return [(p, b) for p in self.prompt_lengths for b in self.batches]

    def mode_points(self) -> list[tuple[int, int, str]]:
        """``(prompt_length, batch, mode)`` of the generate runs (beams and sampling for batches <= 4)."""
        return [(p, b, m) for p, b in self.cells() for m in self.modes if m == "greedy" or b <= 4]

    def distinct_prompts(self, prompt: int) -> int:
        """Distinct prompts prefilled for ``prompt``-token cells (the largest batch's rows at most)."""
        return min(max(self.batches), max(1, self.distinct_tokens // prompt))


#: ``--quick``: the default of ``hf-vkv bench``.
QUICK_GRID = Grid(prompt_lengths=(64, 512), batches=(1, 4), new_tokens=16)
#: ``--full``: the whole grid (the default of ``benchmarks/generate_cpu.py``).
FULL_GRID = Grid(prompt_lengths=(64, 512, 2048, 8192), batches=(1, 4, 8), new_tokens=24)


def prompt_ids(model: PreTrainedModel, prompt: int, batch: int) -> torch.Tensor:
    """``[batch, prompt]`` random ids, seeded by ``(prompt, batch)``, clear of the special tokens."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(prompt * 31 + batch)
    return torch.randint(min(10, vocab - 1), vocab, (batch, prompt), generator=g)


# -------------------------------------------------------------------------------- decode cells
def run_cells(model: PreTrainedModel, grid: Grid, *, progress: bool = False) -> list[dict[str, Any]]:
    """Measure every decode cell of ``grid``; one JSON-able dict per cell (see :func:`_cell_result`)."""
    results = []
    before = torch.get_num_threads()
    for prompt in grid.prompt_lengths:
        n = grid.distinct_prompts(prompt)
        if progress:
            print(f"prefill {n} x {prompt} tokens ...", file=sys.stderr, flush=True)
        state = prefill(model, prompt_ids(model, prompt, n).to(model.device))
        for batch in grid.batches:
            if progress:
                print(f"cell prompt {prompt} batch {batch}: {', '.join(grid.caches)}", file=sys.stderr, flush=True)
            capacity = prompt + grid.new_tokens
            caches = {name: make_cache(name, model, batch, capacity) for name in grid.caches}
            try:
                load_prompt(caches, state, batch)
                torch.set_num_threads(grid.threads)
                timings = time_decode(
                    model, caches, state, batch=batch, new_tokens=grid.new_tokens, rounds=grid.rounds,
                    kv_bytes=dict.fromkeys(caches, cache_kv_bytes),
                    extra={name: _vkv_numbers for name in caches if name in VKV_LAYOUTS})
            finally:
                torch.set_num_threads(before)
                for cache in caches.values():
                    if hasattr(cache, "close"):
                        cache.close()
                del caches
                gc.collect()
            results.append(_cell_result(prompt, batch, min(n, batch), grid, timings))
            if progress:
                print(format_cells(results[-1:], header=False), file=sys.stderr, flush=True)
        del state
        gc.collect()
    return results


def _paired_ratio(a: CacheTiming, b: CacheTiming | None) -> float | None:
    """Median over rounds of ``a``'s step / ``b``'s step in the same round (the caches of a round
    run interleaved, so they share its noise)."""
    if b is None:
        return None
    return statistics.median(x / y for x, y in zip(a.round_step_s, b.round_step_s))


def _cell_result(prompt: int, batch: int, distinct: int, grid: Grid,
                 timings: dict[str, CacheTiming]) -> dict[str, Any]:
    """A cell as JSON: per cache its timing and bytes; per vkv layout its ratios to ideal/dynamic
    (:func:`_paired_ratio`); whether the default layout is within the target of the ideal cache at this cell."""
    caches = {name: dict(step_ms=1e3 * t.step_s, round_step_ms=[1e3 * s for s in t.round_step_s],
                         kv_peak_bytes=t.kv_peak_bytes, kv_end_bytes=t.kv_end_bytes, tokens_equal=t.tokens_equal,
                         first_mismatch=t.first_mismatch, max_abs_logit_diff=t.max_abs_logit_diff, **t.extra)
              for name, t in timings.items()}
    ratios = {name: dict(vs_ideal=_paired_ratio(timings[name], timings.get("ideal")),
                         vs_dynamic=_paired_ratio(timings[name], timings["dynamic"]))
              for name in timings if name in VKV_LAYOUTS}
    default = default_layout()
    target = None
    if default in ratios:  # <= 1.03 x ideal at prompts >= 512; >= 0.97 x DynamicCache's speed below
        r = ratios[default]
        target = (r["vs_ideal"] <= 1.03 if r["vs_ideal"] is not None else None) if prompt >= 512 \
            else 1 / r["vs_dynamic"] >= 0.97
    return dict(prompt=prompt, batch=batch, distinct_prompts=distinct, new_tokens=grid.new_tokens,
                rounds=grid.rounds, tokens_equal=all(t.tokens_equal for t in timings.values()), caches=caches,
                ratios=ratios, default_layout=default, default_meets_target=target)


_SHORT = {"dynamic": "dyn", "ideal": "ideal", "token_major": "tok", "head_major": "head", "per_layer": "layer"}


def format_cells(cells: Sequence[dict[str, Any]], *, header: bool = True) -> str:
    """One line per cell: ms/step per cache, vkv/ideal and vkv/dynamic per layout, utilization per
    layout, tokens, whether the default layout meets the target."""
    if not cells:
        return ""
    names = list(cells[0]["caches"])
    layouts = [n for n in names if n in VKV_LAYOUTS]
    cols = ([f"ms {_SHORT[n]}" for n in names] + [f"{_SHORT[n]}/ideal" for n in layouts if "ideal" in names]
            + [f"{_SHORT[n]}/dyn" for n in layouts] + [f"util {_SHORT[n]}" for n in layouts])
    head = f"{'prompt':>6s} {'batch':>5s} " + " ".join(f"{c:>10s}" for c in cols) + f" {'tokens':>9s} target"
    lines = [head, "-" * len(head)] if header else []
    for c in cells:
        values = [f"{c['caches'][n]['step_ms']:.1f}" for n in names]
        values += [f"{c['ratios'][n]['vs_ideal']:.3f}" for n in layouts if "ideal" in names]
        values += [f"{c['ratios'][n]['vs_dynamic']:.3f}" for n in layouts]
        values += [f"{c['caches'][n]['utilization']:.3f}" for n in layouts]
        target = {None: "-", True: "met", False: "MISSED"}[c["default_meets_target"]]
        lines.append(f"{c['prompt']:6d} {c['batch']:5d} " + " ".join(f"{v:>10s}" for v in values)
                     + f" {'identical' if c['tokens_equal'] else 'DIFFERENT':>9s} {target}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ generate modes
def run_modes(model: PreTrainedModel, grid: Grid, *, seed: int = 1234, progress: bool = False,
              pad_token_id: int | None = None) -> list[dict[str, Any]]:
    """One A/B ``generate()`` run (no tee) per :meth:`Grid.mode_points`; one JSON-able dict each."""
    if pad_token_id is None:
        pad = model.generation_config.pad_token_id
        pad = model.generation_config.eos_token_id if pad is None else pad
        pad_token_id = pad[0] if isinstance(pad, list) else pad
    results = []
    for prompt, batch, mode in grid.mode_points():
        if progress:
            print(f"generate A/B: prompt {prompt} batch {batch} {mode}", file=sys.stderr, flush=True)
        ids = prompt_ids(model, prompt, batch).to(model.device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        report = run_ab(model, inputs, max_new_tokens=grid.new_tokens, min_new_tokens=grid.new_tokens, tee=False,
                        seed=seed, progress=progress, pad_token_id=pad_token_id, **MODES[mode])
        d, v = report.dynamic, report.vkv
        results.append(dict(
            prompt=prompt, batch=batch, mode=mode, rows=report.rows, steps=v.steps,
            tokens_identical=report.tokens_identical, identical=report.identical,
            first_divergence=report.first_divergence.describe() if report.first_divergence else None,
            dynamic=dataclasses.asdict(d), vkv=dataclasses.asdict(v),
            kv_ratio_vs_dynamic=v.kv_peak_bytes / d.kv_peak_bytes if d.kv_peak_bytes else None,
            decode_speedup_vs_dynamic=(d.decode_step_s / v.decode_step_s
                                       if d.decode_step_s and v.decode_step_s else None),
        ))
    return results


def format_modes(results: Sequence[dict[str, Any]]) -> str:
    """One line per generate run: tokens, KV peak of each cache and their ratio, decode step of each."""
    header = (f"{'prompt':>6s} {'batch':>5s} {'mode':8s} {'rows':>4s} {'tokens':>9s} {'KV dyn':>9s} {'KV vkv':>9s} "
              f"{'ratio':>5s} {'step dyn':>9s} {'step vkv':>9s}")
    lines = [header, "-" * len(header)]
    for r in results:
        d, v = r["dynamic"], r["vkv"]
        steps = [("-" if s is None else f"{1e3 * s:.1f}ms") for s in (d["decode_step_s"], v["decode_step_s"])]
        lines.append(
            f"{r['prompt']:6d} {r['batch']:5d} {r['mode']:8s} {r['rows']:4d} "
            f"{'identical' if r['identical'] else 'DIFFERENT':>9s} {d['kv_peak_bytes'] / 2**20:8.2f}M "
            f"{v['kv_peak_bytes'] / 2**20:8.2f}M {r['kv_ratio_vs_dynamic'] or 0:5.2f} {steps[0]:>9s} {steps[1]:>9s}")
    return "\n".join(lines)


def bench_report(cells: Sequence[dict[str, Any]], modes: Sequence[dict[str, Any]], *, model: str, grid: Grid,
                 command: str, environment: dict[str, str]) -> dict[str, Any]:
    """The JSON object both entry points write: schema, command, model, environment, grid, results."""
    return dict(schema=BENCH_SCHEMA_VERSION, command=command, model=model,
                environment={**environment, "timed_threads": str(grid.threads)},
                grid=dataclasses.asdict(grid), cells=list(cells), results=list(modes))


def all_identical(cells: Sequence[dict[str, Any]], modes: Sequence[dict[str, Any]]) -> bool:
    """Every cache of every cell chose DynamicCache's tokens, every generate run was identical."""
    return all(c["tokens_equal"] for c in cells) and all(r["identical"] for r in modes)

"""The benchmark grid of ``hf-vkv bench``: A/B runs over prompt lengths, batches and modes.

Each grid point is one :func:`~hf_vkv.ab.run_ab` without the tee (so the step times are the
caches' own), on random prompt ids, with ``min_new_tokens = max_new_tokens`` so every run decodes
the same number of steps. Per point it keeps the verdict, both runs' summaries (prefill, mean
decode step, wall time, peak KV bytes) and their ratios; :func:`bench_report` wraps the points
with the device, versions and command. The quick grid is the default; :data:`FULL_GRID` is the
one of ``benchmarks/generate_cpu.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from .harness import run_ab

__all__ = [
    "BENCH_SCHEMA_VERSION", "FULL_GRID", "MODES", "QUICK_GRID", "Grid", "bench_report", "format_bench", "run_bench",
]

BENCH_SCHEMA_VERSION = "hf_vkv.bench/1"

#: Generation arguments of each benchmark mode.
MODES: dict[str, dict[str, Any]] = {
    "greedy": dict(do_sample=False),
    "beam4": dict(do_sample=False, num_beams=4),
    "sample8": dict(do_sample=True, num_return_sequences=8, top_k=0, top_p=1.0, temperature=1.0),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Grid:
    """What to run: every prompt length x batch x mode (beam4/sample8 only for batches <= 4, as they
    already multiply the rows)."""

    prompt_lengths: tuple[int, ...]
    batches: tuple[int, ...]
    modes: tuple[str, ...] = tuple(MODES)
    new_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("prompt_lengths", "batches"):
            values = getattr(self, name)
            if not values or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in values):
                raise ValueError(f"{name} must be positive ints, got {values!r}")
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown or not self.modes:
            raise ValueError(f"modes must be some of {sorted(MODES)}, got {list(self.modes)!r}")
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 2:
            raise ValueError(f"new_tokens must be an int >= 2 (a prefill and decode steps), got {self.new_tokens!r}")

    def points(self) -> list[tuple[int, int, str]]:
        """``(prompt_length, batch, mode)`` in run order."""
        return [(p, b, m) for p in self.prompt_lengths for b in self.batches for m in self.modes
                if m == "greedy" or b <= 4]


#: The default of ``hf-vkv bench``: 73 s on SmolLM2 with one thread on the 2-core development machine
#: (``hf-vkv bench --threads 1``, other jobs running).
QUICK_GRID = Grid(prompt_lengths=(64,), batches=(1, 4), new_tokens=16)
#: ``hf-vkv bench --full``: the grid of ``benchmarks/generate_cpu.py`` (tens of minutes on 2 cores).
FULL_GRID = Grid(prompt_lengths=(64, 512, 2048), batches=(1, 4, 8), new_tokens=32)


def run_bench(model: PreTrainedModel, grid: Grid = QUICK_GRID, *, seed: int = 1234, progress: bool = False,
              cache_config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run every point of ``grid``; return one JSON-able result per point (see the module docstring)."""
    from tqdm.auto import tqdm

    vocab = model.config.get_text_config(decoder=True).vocab_size
    low = min(10, vocab - 1)  # keep clear of the special tokens at the start of most vocabularies
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    device = next(model.parameters()).device
    results = []
    points = grid.points()
    with tqdm(points, desc="bench", unit="run", file=sys.stderr, disable=not progress) as bar:
        for prompt, batch, mode in bar:
            bar.set_postfix_str(f"prompt {prompt} batch {batch} {mode}")
            g = torch.Generator().manual_seed(prompt * 31 + batch)
            ids = torch.randint(low, vocab, (batch, prompt), generator=g).to(device)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            report = run_ab(model, inputs, max_new_tokens=grid.new_tokens, min_new_tokens=grid.new_tokens, tee=False,
                            seed=seed, progress=progress, cache_config=cache_config, pad_token_id=pad, **MODES[mode])
            d, v = report.dynamic, report.vkv
            results.append(dict(
                prompt=prompt, batch=batch, mode=mode, rows=report.rows, steps=v.steps,
                tokens_identical=report.tokens_identical, identical=report.identical,
                first_divergence=report.first_divergence.describe() if report.first_divergence else None,
                dynamic=dataclasses.asdict(d), vkv=dataclasses.asdict(v),
                kv_ratio_vs_dynamic=v.kv_peak_bytes / d.kv_peak_bytes if d.kv_peak_bytes else None,
                decode_speedup_vs_dynamic=(d.decode_step_s / v.decode_step_s
                                           if d.decode_step_s and v.decode_step_s else None),
                wall_ratio_vs_dynamic=v.wall_s / d.wall_s if d.wall_s else None,
            ))
    return results


def bench_report(results: Sequence[dict[str, Any]], *, model: str, grid: Grid, command: str,
                 environment: dict[str, str]) -> dict[str, Any]:
    """The JSON object ``hf-vkv bench`` writes: schema, command, environment, grid, results."""
    return dict(schema=BENCH_SCHEMA_VERSION, command=command, model=model, environment=environment,
                grid=dataclasses.asdict(grid), results=list(results))


def format_bench(results: Sequence[dict[str, Any]]) -> str:
    """One line per grid point: tokens, KV peak of each cache and their ratio, decode step of each."""
    header = (f"{'prompt':>6s} {'batch':>5s} {'mode':8s} {'rows':>4s} {'tokens':>9s} {'KV dyn':>9s} {'KV vkv':>9s} "
              f"{'ratio':>5s} {'step dyn':>9s} {'step vkv':>9s} {'speedup':>7s} {'wall ratio':>10s}")
    lines = [header, "-" * len(header)]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.1f}ms"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for r in results:
        d, v = r["dynamic"], r["vkv"]
        lines.append(
            f"{r['prompt']:6d} {r['batch']:5d} {r['mode']:8s} {r['rows']:4d} "
            f"{'identical' if r['tokens_identical'] else 'DIFFERENT':>9s} {d['kv_peak_bytes'] / 2**20:8.2f}M "
            f"{v['kv_peak_bytes'] / 2**20:8.2f}M {num(r['kv_ratio_vs_dynamic']):>5s} {ms(d['decode_step_s']):>9s} "
            f"{ms(v['decode_step_s']):>9s} {num(r['decode_speedup_vs_dynamic']):>7s} "
            f"{num(r['wall_ratio_vs_dynamic']):>10s}"
        )
    return "\n".join(lines)

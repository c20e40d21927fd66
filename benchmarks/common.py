"""Pieces the benchmark scripts share (they run as ``python benchmarks/<name>.py``, so this
module imports as ``common``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor
from transformers.generation.streamers import BaseStreamer

__all__ = ["StepClock", "StepMarks", "dispatch", "ideal_beam_cache", "write_report"]


class StepClock(BaseStreamer):
    """A streamer that records when each ``put`` arrives: the first is the prompt, then one per
    decode step (tokens reach the streamer on the host, so on a GPU each time follows a sync)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_seconds(self) -> float | None:
        """Mean seconds per decode step, prefill excluded (None with fewer than two steps)."""
        gen = self.times[1:]
        return (gen[-1] - gen[0]) / (len(gen) - 1) if len(gen) > 1 else None


class StepMarks(LogitsProcessor):
    """A logits processor that records when ``generate`` calls it (once per step, beam search
    included, where a streamer cannot be used): a decode step is the gap between two calls (the
    token choice, the cache reorder and one forward)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores

    def median_step(self) -> float:
        """Median seconds between two calls."""
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:]))
        mid = len(gaps) // 2
        return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2


def dispatch(argv: list[str] | None, default: Callable[[list[str]], Any],
             subcommands: dict[str, Callable[[list[str]], Any]]) -> Any:
    """A script's ``main``: ``subcommands[name](rest)`` when the first argument names a subcommand,
    else ``default(argv)`` (the script's own measurement); ``argv`` defaults to ``sys.argv[1:]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in subcommands:
        return subcommands[argv[0]](argv[1:])
    return default(argv)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder made if missing) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def ideal_beam_cache(model: Any, ids: torch.Tensor, *, beams: int, new: int) -> Any:
    """The benchmarks' ideal cache for a ``beams``-beam search of ``new`` tokens on the one-row
    prompt ``ids`` (``[1, P]``): its ``[beams, H, P + new + 1, D]`` buffers hold the prompt's K/V
    (from a DynamicCache prefill) in every row; ``generate`` continues from it."""
    from transformers import DynamicCache

    from hf_vkv.ab.decode import Prompt, load_prompt
    from hf_vkv.ab.ideal import IdealCache

    one = DynamicCache(config=model.config)
    first = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=one, max_new_tokens=1,
                           do_sample=False)
    one.crop(-1)
    prompt = Prompt(keys=tuple(layer.keys for layer in one.layers),
                    values=tuple(layer.values for layer in one.layers), first_tokens=first[:, -1])
    cache = IdealCache(model.config, capacity=ids.shape[1] + new + 1)
    load_prompt({"ideal": cache}, prompt, beams)
    return cache

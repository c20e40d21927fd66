"""Pieces the benchmark scripts share (they run as ``python benchmarks/<name>.py``, so this
module imports as ``common``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor
from transformers.generation.streamers import BaseStreamer

__all__ = ["StepClock", "StepMarks", "write_report"]


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


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder made if missing) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")

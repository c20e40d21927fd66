"""The demo's step columns come with their spread, and a verdict on whether they can be read."""

from __future__ import annotations

import dataclasses

import pytest

from hf_vkv.ab import run_ab
from hf_vkv.ab.table import format_step_spread, step_spread
from models import prompts, tiny

pytestmark = pytest.mark.integration


def _with_times(report, dynamic: list[float], vkv: list[float]):
    """``report`` with its decode steps' times (and the mean steps) replaced."""
    steps = [report.steps[0]] + [dataclasses.replace(s, time_dynamic_s=d, time_vkv_s=v)
                                 for s, d, v in zip(report.steps[1:], dynamic, vkv)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return dataclasses.replace(report, steps=steps,
                               dynamic=dataclasses.replace(report.dynamic, decode_step_s=mean(dynamic)),
                               vkv=dataclasses.replace(report.vkv, decode_step_s=mean(vkv)))


def test_spread_and_verdicts() -> None:
    report = run_ab(tiny("llama"), prompts(1, 6), max_new_tokens=11, tee=False)
    assert len(report.steps) == 11
    steady = _with_times(report, [0.010] * 10, [0.005] * 9 + [0.0051])
    assert step_spread(steady, "dynamic") == 0.0 and 0 < step_spread(steady, "vkv") < 0.05
    assert "difference of the means is wider than both spreads: vkv's step is faster" in format_step_spread(
        [("steady", steady)])
    slower = _with_times(report, [0.005] * 10, [0.010] * 9 + [0.0101])
    assert "wider than both spreads: vkv's step is slower" in format_step_spread([("slower", slower)])
    close = _with_times(report, [0.010, 0.012] * 5, [0.011, 0.0105] * 5)
    assert "within it: no speed difference can be read" in format_step_spread([("close", close)])
    busy = _with_times(report, [0.010, 0.100] * 5, [0.010] * 10)
    assert step_spread(busy, "dynamic") > 1
    assert "too wide to read the step columns" in format_step_spread([("busy", busy)])
    real = format_step_spread([("real", report)])
    assert real.startswith("step spread") and "real: dynamic" in real

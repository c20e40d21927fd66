"""Plain-text tables of A/B reports: one report step by step, or several reports one line each
(memory and decode step; time to first token and decode step beside memory; where the memory goes)."""

from __future__ import annotations

import statistics

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .records import ABReport, StepReport

if TYPE_CHECKING:
    from ..cache import CacheStats

__all__ = ["format_report", "format_savings", "format_step_spread", "format_summary", "format_times", "step_spread"]

#: Above this relative spread of single decode steps a run's step times are not read as a speed.
TOO_WIDE = 0.5

MiB = 2**20


def _mib(n: int | None) -> str:
    """Bytes in MiB (KiB below 1 MiB, so the tiny models' caches do not all read 0.00)."""
    if n is None:
        return "-"
    return f"{n / MiB:.2f}Mi" if n >= MiB else f"{n / 1024:.1f}Ki"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.1f}"


def _yes(flag: bool | None, *, yes: str = "same", no: str = "DIFF") -> str:
    return "-" if flag is None else yes if flag else no


def _diff(x: float | None) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.2g}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or b is None else f"{b / a:.2f}"


def _shown(steps: Sequence[StepReport], keep: set[int], max_steps: int) -> list[StepReport | None]:
    """All steps when few; else the first and last few plus ``keep``, ``None`` marking a gap."""
    if len(steps) <= max_steps:
        return list(steps)
    edge = max_steps // 2
    chosen = sorted({*range(edge), *range(len(steps) - edge, len(steps)), *(k for k in keep if k < len(steps))})
    out: list[StepReport | None] = []
    for i, t in enumerate(chosen):
        if i and t != chosen[i - 1] + 1:
            out.append(None)
        out.append(steps[t])
    return out


def format_report(report: ABReport, *, max_steps: int = 24) -> str:
    """A header, one line per step (at most ``max_steps`` lines, the divergence always shown) and the
    verdict."""
    d, v = report.dynamic, report.vkv
    kwargs = ", ".join(f"{k}={val}" for k, val in report.generate_kwargs.items())
    lines = [
        f"A/B against DynamicCache: {report.model} ({report.environment.get('device', '?')}, "
        f"{report.environment.get('dtype', '?')}), layout {report.layout}, {report.mode} ({kwargs}), "
        f"seed {report.seed}",
        f"prompt {report.prompt_tokens} tokens x {report.batch}, {report.rows} rows; tee "
        f"{'on (K/V of every layer compared)' if report.tee else 'off'}",
        "",
    ]
    header = (f"{'step':>4s} {'tokens':>6s} {'K/V':>4s} {'max|dlogit|':>11s} {'KV dynamic':>10s} {'KV vkv':>9s} "
              f"{'ratio':>5s} {'ms dyn':>7s} {'ms vkv':>7s}")
    lines += [header, "-" * len(header)]
    keep = {report.first_divergence.step} if report.first_divergence else set()
    for s in _shown(report.steps, keep, max_steps):
        if s is None:
            lines.append(f"{'...':>4s}")
            continue
        lines.append(
            f"{s.step:4d} {_yes(s.tokens_equal):>6s} {_yes(s.kv_equal):>4s} {_diff(s.max_abs_logit_diff):>11s} "
            f"{_mib(s.kv_bytes_dynamic):>10s} {_mib(s.kv_bytes_vkv):>9s} "
            f"{_ratio(s.kv_bytes_dynamic, s.kv_bytes_vkv):>5s} {_ms(s.time_dynamic_s):>7s} {_ms(s.time_vkv_s):>7s}"
        )
    lines += [
        "-" * len(header),
        f"KV peak: dynamic {_mib(d.kv_peak_bytes)}, vkv {_mib(v.kv_peak_bytes)} "
        f"(vkv/dynamic {_ratio(d.kv_peak_bytes, v.kv_peak_bytes)})",
        f"decode step (mean of steps 1..{max(d.steps, v.steps) - 1}): dynamic {_ms(d.decode_step_s)} ms, "
        f"vkv {_ms(v.decode_step_s)} ms; prefill {_ms(d.prefill_s)} / {_ms(v.prefill_s)} ms; "
        f"wall {d.wall_s:.2f} / {v.wall_s:.2f} s",
    ]
    if report.prefix_reuse is not None and not report.identical and report.reference == "prefill":
        lines.append(
            f"{'PASSED' if report.passed else 'FAILED'} (against a full prefill: prefix reuse prefills only the tokens "
            f"not stored, over stored K/V): tokens {'identical' if report.tokens_identical else 'differ'}, max |dlogit| "
            f"{_diff(report.max_abs_logit_diff)} over {len(report.steps)} steps")
    elif report.layout == "cascade":
        lines.append(
            f"{'PASSED' if report.passed else 'FAILED'} (cascade attention reorders float sums): tokens "
            f"{'identical' if report.tokens_identical else 'differ'}, max |dlogit| "
            f"{_diff(report.max_abs_logit_diff)} over {len(report.steps)} steps, "
            + ("no bound for this dtype" if report.logit_bound is None else
               f"{'within' if report.within_bound else 'OVER'} its {report.environment.get('dtype')} bound "
               f"{report.logit_bound:g}"))
    elif report.identical:
        what = "tokens, logits and K/V" if report.tee else "tokens and logits"
        lines.append(f"IDENTICAL: {what} equal at all {len(report.steps)} steps")
    else:
        where = report.first_divergence.describe() if report.first_divergence else "the returned sequences"
        lines.append(f"DIVERGED (tokens {'identical' if report.tokens_identical else 'differ'}); first at {where}")
    return "\n".join(lines)


def format_summary(reports: Sequence[tuple[str, ABReport]], *,
                   ideal_kv_bytes: Sequence[int | None] | None = None) -> str:
    """One line per labelled report: rows, prompt, verdict, KV peak of each cache and their ratio,
    vkv against an ideal cache (``ideal_kv_bytes``, one per report; ``-`` where unknown), mean
    decode step of each cache.

    ``identical`` means tokens, logits and (with the tee) K/V equal at every step."""
    ideal = list(ideal_kv_bytes) if ideal_kv_bytes is not None else [None] * len(reports)
    header = (f"{'run':24s} {'rows':>4s} {'prompt':>6s} {'tokens':>9s} {'KV dynamic':>10s} {'KV vkv':>9s} "
              f"{'vkv/dyn':>7s} {'vkv/ideal':>9s} {'step dyn':>9s} {'step vkv':>9s}")
    lines = [header, "-" * len(header)]
    for (label, r), best in zip(reports, ideal):
        lines.append(
            f"{label:24s} {r.rows:4d} {r.prompt_tokens:6d} {'identical' if r.identical else 'DIFFERENT':>9s} "
            f"{_mib(r.dynamic.kv_peak_bytes):>10s} {_mib(r.vkv.kv_peak_bytes):>9s} "
            f"{_ratio(r.dynamic.kv_peak_bytes, r.vkv.kv_peak_bytes):>7s} {_ratio(best, r.vkv.kv_peak_bytes):>9s} "
            f"{_ms(r.dynamic.decode_step_s) + 'ms':>9s} {_ms(r.vkv.decode_step_s) + 'ms':>9s}"
        )
    return "\n".join(lines)


def format_savings(items: Sequence[tuple[str, CacheStats | None]]) -> str:
    """Where vkv's memory goes, one line per labelled ``VKVCache.stats()`` (taken after
    ``generate()`` returned): resident and live bytes, their ratio (utilization), pages held by
    more than one row, pages copied on write, rows that took their prompt from another row."""
    header = (f"{'run':24s} {'resident':>9s} {'live KV':>9s} {'utilization':>11s} {'shared pages':>12s} "
              f"{'CoW copies':>10s} {'rows sharing the prompt':>23s}")
    lines = [header, "-" * len(header)]
    for label, s in items:
        if s is None:
            lines.append(f"{label:24s} {'-':>9s}")
            continue
        prompt_rows = sum(g.shared_prompt_rows for g in s.groups)
        lines.append(
            f"{label:24s} {_mib(s.resident_bytes):>9s} {_mib(s.token_bytes):>9s} {s.utilization:11.0%} "
            f"{s.shared_pages:12d} {s.cow_copies:10d} {prompt_rows:23d}"
        )
    return "\n".join(lines)


def format_times(reports: Sequence[tuple[str, ABReport]]) -> str:
    """Time beside memory, one line per labelled report: time to first token (step 0: set-up,
    prefill, first logits) and mean decode step of each cache, vkv/dynamic of each, and the KV
    peak of each cache."""
    header = (f"{'run':24s} {'TTFT dyn':>9s} {'TTFT vkv':>9s} {'vkv/dyn':>7s} {'step dyn':>9s} {'step vkv':>9s} "
              f"{'vkv/dyn':>7s} {'KV dynamic':>10s} {'KV vkv':>9s}")
    lines = [header, "-" * len(header)]
    for label, r in reports:
        d, v = r.dynamic, r.vkv
        lines.append(
            f"{label:24s} {_ms(d.prefill_s) + 'ms':>9s} {_ms(v.prefill_s) + 'ms':>9s} "
            f"{_ratio(d.prefill_s, v.prefill_s):>7s} "
            f"{_ms(d.decode_step_s) + 'ms':>9s} {_ms(v.decode_step_s) + 'ms':>9s} "
            f"{_ratio(d.decode_step_s, v.decode_step_s):>7s} {_mib(d.kv_peak_bytes):>10s} {_mib(v.kv_peak_bytes):>9s}"
        )
    return "\n".join(lines)


def step_spread(report: ABReport, cache: str) -> float | None:
    """Spread of ``cache``'s (``"dynamic"`` / ``"vkv"``) single decode steps (steps 1..): the 10th
    to 90th percentile range over the median; ``None`` with fewer than 3 decode steps."""
    times = [t for s in report.steps[1:] if (t := getattr(s, f"time_{cache}_s")) is not None]
    if len(times) < 3:
        return None
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    median = statistics.median(times)
    return (deciles[-1] - deciles[0]) / median if median > 0 else None


def format_step_spread(reports: Sequence[tuple[str, ABReport]]) -> str:
    """One line per labelled report: the spread of each cache's single decode steps and whether
    the difference of the mean steps can be read as a speed difference (it is larger than both
    spreads, and neither spread exceeds :data:`TOO_WIDE`)."""
    lines = ["step spread (10th-90th percentile of single decode steps, over their median):"]
    for label, r in reports:
        d, v = step_spread(r, "dynamic"), step_spread(r, "vkv")
        if d is None or v is None or not r.dynamic.decode_step_s or r.vkv.decode_step_s is None:
            lines.append(f"  {label}: too few decode steps to say")
            continue
        diff = abs(r.vkv.decode_step_s / r.dynamic.decode_step_s - 1)
        if max(d, v) > TOO_WIDE:
            verdict = "too wide to read the step columns (a busy machine?); rerun on an idle one"
        elif diff <= max(d, v):
            verdict = f"the {diff:.0%} difference of the means is within it: no speed difference can be read"
        else:
            faster = r.vkv.decode_step_s < r.dynamic.decode_step_s
            verdict = (f"the {diff:.0%} difference of the means is wider than both spreads: vkv's step is "
                       f"{'faster' if faster else 'slower'}")
        lines.append(f"  {label}: dynamic {d:.0%}, vkv {v:.0%}: {verdict}")
    return "\n".join(lines)

"""A plot of an A/B report: KV memory of both caches over the steps, and the step times.

matplotlib is optional (``pip install hf_vkv[plot]``) and imported only when a plot is drawn,
with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path

from ..memory.errors import MissingDependencyError
from .records import ABReport

__all__ = ["plot_report"]


def plot_report(report: ABReport, path: str | Path) -> Path:
    """Write a PNG with two panels over the steps: resident KV MiB (DynamicCache, vkv) and step time
    (ms); the first divergence, if any, is marked. Returns ``path``.

    Raises:
        MissingDependencyError: matplotlib is not installed (a ``ModuleNotFoundError``; the message says how
            to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as e:
        raise MissingDependencyError("plots need matplotlib: pip install 'hf_vkv[plot]' (or pip install matplotlib)",
                                     name="matplotlib") from e
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = [s.step for s in report.steps]
    series = {
        "DynamicCache": ([s.kv_bytes_dynamic for s in report.steps], [s.time_dynamic_s for s in report.steps]),
        "vkv": ([s.kv_bytes_vkv for s in report.steps], [s.time_vkv_s for s in report.steps]),
    }
    fig, (mem, speed) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for (label, (kv, times)), style in zip(series.items(), ("-o", "-s")):
        xs = [x for x, y in zip(steps, kv) if y is not None]
        mem.plot(xs, [y / 2**20 for y in kv if y is not None], style, markersize=3, label=label)
        xs = [x for x, y in zip(steps, times) if y is not None and x > 0]  # step 0 is the prefill
        speed.plot(xs, [1e3 * y for x, y in zip(steps, times) if y is not None and x > 0], style, markersize=3,
                   label=label)
    if report.first_divergence is not None:
        for ax in (mem, speed):
            ax.axvline(report.first_divergence.step, color="red", linestyle="--", label="first divergence")
    verdict = "identical" if report.identical else "DIVERGED"
    mem.set_title(f"{report.model}: {report.mode}, {report.rows} rows, layout {report.layout} ({verdict})",
                  fontsize=9)
    mem.set_ylabel("resident KV (MiB)")
    speed.set_ylabel("step time (ms)")
    speed.set_xlabel("generation step (0 = prefill, not shown below)")
    for ax in (mem, speed):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

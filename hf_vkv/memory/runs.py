"""Runs of consecutive integers: how backends batch page ids and page slots into fewer calls.

A backend maps, unmaps or releases a run of consecutive ids (or slots) with one system or driver
call, so both the host and the CUDA backend split what they are given into such runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import sub

__all__ = ["consecutive_runs", "is_one_run"]


def consecutive_runs(values: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Split ``values`` into maximal runs of consecutive integers, in order: ``(first, length)``.

    ``consecutive_runs([3, 4, 5, 9, 2, 3])`` yields ``(3, 3), (9, 1), (2, 2)``; the runs' lengths
    add up to ``len(values)``, so a caller can track each run's position in ``values``.
    """
    n = len(values)
    if not n:
        return
    if is_one_run(values):  # a row's pages, a shared prompt's: no loop per value
        yield int(values[0]), n
        return
    # where a step is not +1, found in one pass over the differences (C-level map, no index loop)
    breaks = [i for i, step in enumerate(map(sub, values[1:], values[:-1]), 1) if step != 1]
    start = 0
    for end in breaks:
        yield int(values[start]), end - start
        start = end
    yield int(values[start]), n - start


def is_one_run(values: Sequence[int]) -> bool:
    """Whether the non-empty ``values`` are one run of consecutive integers (checked in C; a
    ``range`` by its step)."""
    if type(values) is range:
        return values.step == 1
    first, n = values[0], len(values)
    return values[-1] - first == n - 1 and (n < 3 or list(values) == list(range(first, first + n)))

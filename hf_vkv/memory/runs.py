"""Runs of consecutive integers: how backends batch page ids and page slots into fewer calls.

A backend maps, unmaps or releases a run of consecutive ids (or slots) with one system or driver
call, so both the host and the CUDA backend split what they are given into such runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["consecutive_runs"]


def consecutive_runs(values: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Split ``values`` into maximal runs of consecutive integers, in order: ``(first, length)``.

    ``consecutive_runs([3, 4, 5, 9, 2, 3])`` yields ``(3, 3), (9, 1), (2, 2)``; the runs' lengths
    add up to ``len(values)``, so a caller can track each run's position in ``values``.
    """
    i = 0
    while i < len(values):
        j = i + 1
        while j < len(values) and values[j] == values[j - 1] + 1:
            j += 1
        yield int(values[i]), j - i
        i = j

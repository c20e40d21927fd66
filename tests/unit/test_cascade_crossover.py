"""Where the ``"vkv_cascade"`` attention reads a shared prefix once: the decision at its exact
thresholds (:func:`hf_vkv.devices.cascade_refusal`), and the table it reads checked against the
committed measurements that set it (``benchmarks/results/cascade_crossover*.json`` for one layer's
attention in sampling's shape, ``benchmarks/results/cascade_beams_cpu.json`` for 4 beams' steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_vkv import devices

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 7, 8, 16])
def test_each_cluster_takes_the_entry_of_the_most_measured_threads_and_rows_at_or_below_it(rows: int,
                                                                                           threads: int) -> None:
    by_rows = devices.CASCADE_MIN_SHARED_TOKENS[max(t for t in devices.CASCADE_MIN_SHARED_TOKENS if t <= threads)]
    entry = max(r for r in by_rows if r <= rows)
    least = by_rows[entry]
    where = "(hf_vkv.devices.CASCADE_MIN_SHARED_TOKENS, measured)"
    if least is None:
        assert devices.cascade_refusal(shared_tokens=10 ** 6, rows=rows, threads=threads) == (
            f"sdpa: {rows} rows share {10 ** 6} tokens; reading them once did not pay for {entry}+ rows at "
            f"{threads} thread(s) at any length measured {where}")
        return
    assert devices.cascade_refusal(shared_tokens=least, rows=rows, threads=threads) is None
    assert devices.cascade_refusal(shared_tokens=least + 1000, rows=rows, threads=threads) is None
    assert devices.cascade_refusal(shared_tokens=least - 1, rows=rows, threads=threads) == (
        f"sdpa: {rows} rows share {least - 1} tokens; reading them once pays for {entry}+ rows from {least} shared "
        f"tokens at {threads} thread(s) {where}")


def test_exact_thresholds_of_a_given_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "CASCADE_MIN_SHARED_TOKENS", {1: {2: 4096, 4: 1024, 8: 512}, 4: {2: None, 8: 256}})
    assert devices.cascade_refusal(shared_tokens=1024, rows=4, threads=1) is None
    assert devices.cascade_refusal(shared_tokens=1023, rows=4, threads=1) is not None
    assert devices.cascade_refusal(shared_tokens=1024, rows=3, threads=1).startswith(
        "sdpa: 3 rows share 1024 tokens; reading them once pays for 2+ rows from 4096")
    assert devices.cascade_refusal(shared_tokens=512, rows=9, threads=2) is None  # 2 threads: the 1-thread entries
    assert devices.cascade_refusal(shared_tokens=256, rows=8, threads=5) is None
    assert devices.cascade_refusal(shared_tokens=255, rows=8, threads=4) is not None
    assert "did not pay for 2+ rows at 4 thread(s)" in devices.cascade_refusal(shared_tokens=10 ** 6, rows=4, threads=4)
    assert devices.cascade_refusal(shared_tokens=10 ** 6, rows=1, threads=1) == "sdpa: 1 row(s) share nothing to read once"


def test_the_default_threads_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "CASCADE_MIN_SHARED_TOKENS", {1: {2: 100}, 2: {2: None}})
    monkeypatch.setattr(devices.torch, "get_num_threads", lambda: 2)
    assert "at 2 thread(s)" in devices.cascade_refusal(shared_tokens=500, rows=2)
    monkeypatch.setattr(devices.torch, "get_num_threads", lambda: 1)
    assert devices.cascade_refusal(shared_tokens=500, rows=2) is None


def _crossing(points: dict[int, float]) -> int | None:
    """The fewest shared tokens from which the cascade was faster at every longer length measured
    (``points``: shared tokens -> cascade/sdpa time); ``None`` when it was not at the longest."""
    found = None
    for tokens in sorted(points, reverse=True):
        if points[tokens] >= 1.0:
            break
        found = tokens
    return found


def test_the_table_is_the_committed_measurements_crossover() -> None:
    expected: dict[int, dict[int, int | None]] = {}
    for threads, name in ((1, "cascade_crossover.json"), (2, "cascade_crossover_t2.json")):
        report = json.loads((RESULTS / name).read_text())
        assert report["threads"] == threads
        by_rows: dict[int, dict[int, float]] = {}
        for cell in report["cells"]:
            by_rows.setdefault(cell["rows"], {})[cell["prefix"]] = cell["cascade_over_sdpa"]
        expected[threads] = {rows: _crossing(points) for rows, points in by_rows.items()}
    beams: dict[int, dict[int, float]] = {}
    report = json.loads((RESULTS / "cascade_beams_cpu.json").read_text())
    for row in report["rows"]:
        assert row["tokens_identical"] and len(row["shared_tokens_read_once"]) == 1
        beams.setdefault(row["threads"], {})[row["shared_tokens_read_once"][0]] = row["cascade_over_sdpa"]
    assert set(beams) == set(expected) == {1, 2}
    for threads, points in beams.items():  # 4 rows: the larger of the beams' steps and one layer's attention
        found = (_crossing(points), expected[threads][4])
        expected[threads][4] = None if None in found else max(found)
    assert devices.CASCADE_MIN_SHARED_TOKENS == expected

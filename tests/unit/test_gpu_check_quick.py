"""``scripts/gpu_check.sh quick``, the first thing to run when a GPU is at hand, exercised where
CI runs (no GPU): its plan (parts ordered by value, each bounded, the whole inside 7 minutes), its
CPU-side mode (the pytest selections and the decode table's arguments resolve, the device parts
are skipped and named, exit 0), its deadline, and the reporting that keeps what a part cut short
had measured (``tests/gpu/gpu_check_report.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
_spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "tests" / "gpu" / "gpu_check_report.py")
gpu_check_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check_report)

DEVICE_PARTS = ["bindings", "bindings-vmm", "identity", "table"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_FORCE_MODE": "cpu",
           "GPU_CHECK_RESULTS": str(tmp_path / "results"), "OUT": str(tmp_path / "out")}
    env.update(extra)
    return env


def _plan() -> tuple[dict[str, list[tuple[str, int, str]]], int]:
    out = subprocess.run(["bash", str(SCRIPT), "quick", "--plan"], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    plan: dict[str, list[tuple[str, int, str]]] = {"device": [], "cpu": []}
    budget = None
    for line in out.splitlines():
        fields = line.split("\t")
        if fields[0] == "budget":
            budget = int(fields[1])
        else:
            plan[fields[0]].append((fields[1], int(fields[2]), fields[3]))
    assert budget is not None, out
    return plan, budget


def test_the_plan_runs_bindings_then_identity_then_the_table_inside_seven_minutes() -> None:
    plan, budget = _plan()
    names = [name for name, _, _ in plan["device"]]
    assert names[:4] == DEVICE_PARTS, names  # ordered by value
    assert budget <= 7 * 60 - 20, budget  # the stage's deadline, with margin inside the 7 minutes
    assert sum(b for _, b, _ in plan["device"]) <= budget  # every part can have its whole budget
    assert all(0 < b for _, b, _ in plan["device"] + plan["cpu"])
    what = dict((name, w) for name, _, w in plan["device"])
    assert "fp16" in what["identity"] and "bf16" in what["identity"] and "2 MiB" in what["identity"]
    assert all(k in what["identity"] for k in ("greedy", "beams", "sampling"))
    assert all(k in what["table"] for k in ("DynamicCache", "StaticCache", "1k", "4k", "batch 1 and 8", "KV bytes"))
    assert [name for name, _, _ in plan["cpu"]][:1] == ["preflight-collect"]


def test_without_a_gpu_the_cpu_parts_run_and_the_device_parts_are_named_as_skipped(tmp_path: Path) -> None:
    parts = ["preflight-collect", "preflight-table"]  # cpu-unit's tests run in this suite already
    run = subprocess.run(["bash", str(SCRIPT), "quick"], capture_output=True, text=True, timeout=55,
                         env=_env(tmp_path, GPU_CHECK_PARTS=" ".join(parts)))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "SKIPPED, no CUDA GPU here" in run.stdout
    for name in DEVICE_PARTS:
        assert f"  - {name}: " in run.stdout, name
    assert "ctx   4096 batch   8" in run.stdout  # the table's cells, from gpu_generate.py --dry-run
    report = json.loads((tmp_path / "results" / "gpu_check_quick.json").read_text())
    assert report["mode"] == "cpu" and report["complete"] and report["exit_code"] == 0
    assert [p["name"] for p in report["parts"]] == parts
    assert all(p["exit_code"] == 0 and not p["timed_out"] for p in report["parts"])
    skipped = {s["name"]: s["reason"] for s in report["skipped"]}
    assert all("no CUDA GPU" in skipped[name] for name in DEVICE_PARTS)
    assert skipped["cpu-unit"] == "not in GPU_CHECK_PARTS"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check_quick.json", "gpu_check_quick.log"]


def test_a_spent_budget_skips_the_remaining_parts_and_says_so(tmp_path: Path) -> None:
    run = subprocess.run(["bash", str(SCRIPT), "quick"], capture_output=True, text=True, timeout=55,
                         env=_env(tmp_path, QUICK_BUDGET="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "results" / "gpu_check_quick.json").read_text())
    assert report["parts"] == []
    assert [s["reason"] for s in report["skipped"] if s["name"] == "cpu-unit"] == ["no time left in the stage's 1 s"]


def test_a_part_cut_short_keeps_its_outcomes_and_names_the_test_it_was_running(tmp_path: Path) -> None:
    progress = tmp_path / "identity.jsonl"
    lines = [{"event": "start", "test": "t::a"}, {"event": "end", "test": "t::a", "outcome": "passed", "seconds": 1.0},
             {"event": "start", "test": "t::b"},
             {"event": "end", "test": "t::b", "outcome": "failed", "seconds": 2.0, "detail": "tokens differ"},
             {"event": "start", "test": "t::c"}]
    progress.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"event": "end", "te')  # cut by a SIGKILL
    table = tmp_path / "gpu_generate_quick.json"
    table.write_text(json.dumps({"complete": False, "results": [{"tokens_identical": True}, {"error": "OOM"},
                                                                 {"tokens_identical": False}]}))
    report = tmp_path / "gpu_check_quick.json"
    assert gpu_check_report.main(["start", str(report), "device", "H100", "400"]) == 0
    assert gpu_check_report.main(["part", str(report), "identity", "what", "140", "140", "150", "124",
                                  str(progress), str(table), str(tmp_path / "absent.json")]) == 0
    part = json.loads(report.read_text())["parts"][0]
    assert part["timed_out"] and part["tests"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    assert part["running_when_stopped"] == "t::c"
    assert part["not_passed"] == [{"test": "t::b", "outcome": "failed", "seconds": 2.0, "detail": "tokens differ"}]
    assert part["files"]["gpu_generate_quick.json"] == {"written": True, "complete": False, "cells": 3, "errors": 1,
                                                        "not_identical": 1}
    assert part["files"]["absent.json"] == "not written"

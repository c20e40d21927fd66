"""The reporting half of ``scripts/gpu_check.sh quick``: a pytest plugin that writes each test's
outcome as it happens, and a command that folds one finished (or cut-short) part into the quick
stage's JSON.

As a pytest plugin (``-p gpu_check_report``, with ``tests/gpu`` on ``PYTHONPATH``), when
``GPU_CHECK_PROGRESS`` names a file, one JSON line is appended (and flushed) when a test starts
and one when it ends, so a part killed by its timeout still says what passed, what failed and
which test was running when the time ran out. pytest's own ``--junitxml`` is written only at the
end of a session, so a hang in a driver call (which a SIGINT cannot interrupt, then a SIGKILL
follows) would lose it.

As a command (no torch import: it costs nothing when the GPU's time is counted)::

    python3 tests/gpu/gpu_check_report.py start REPORT MODE DEVICE BUDGET
    python3 tests/gpu/gpu_check_report.py part REPORT NAME WHAT BUDGET TIMEOUT SECONDS RC [PROGRESS] [FILE ...]
    python3 tests/gpu/gpu_check_report.py skip REPORT NAME WHAT REASON
    python3 tests/gpu/gpu_check_report.py finish REPORT RC SECONDS

``REPORT`` (``gpu_check_quick.json``) is read, the part appended, and written again at once:
the JSON is complete up to the last finished part whenever the stage stops.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

_ENV = "GPU_CHECK_PROGRESS"


def _append(record: dict) -> None:
    path = os.environ.get(_ENV)
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------- pytest plugin


def pytest_runtest_logstart(nodeid, location) -> None:  # noqa: ARG001  (pytest's hook signature)
    _append({"event": "start", "test": nodeid, "time": time.time()})


def pytest_runtest_logreport(report) -> None:
    # one "end" line per test: its call, or the setup/teardown that failed or skipped it
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed):
        outcome = "failed" if report.failed else "skipped" if report.skipped else "passed"
        if report.when != "call" and report.failed:
            outcome = "error"
        record = {"event": "end", "test": report.nodeid, "when": report.when, "outcome": outcome,
                  "seconds": round(report.duration, 3)}
        if outcome != "passed":
            detail = report.longrepr
            if isinstance(detail, tuple):  # a skip: (file, line, reason)
                detail = detail[-1]
            record["detail"] = str(detail)[-1500:]
        _append(record)


# ------------------------------------------------------------------------------- the quick JSON


def read_progress(path: str | None) -> dict:
    """Counts, the tests that did not pass, and the test that started but never ended (the one
    running when the part was cut short), from a progress file."""
    if not path or not Path(path).exists():
        return {}
    started: list[str] = []
    ended: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a SIGKILL
            continue
        if record.get("event") == "start":
            started.append(record["test"])
        elif record.get("event") == "end":
            previous = ended.get(record["test"])
            if previous is None or previous["outcome"] == "passed":  # a failed teardown after a passed call
                ended[record["test"]] = record
    outcomes = [r["outcome"] for r in ended.values()]
    out = {"tests": {k: outcomes.count(k) for k in ("passed", "failed", "error", "skipped")},
           "not_passed": [{k: r[k] for k in ("test", "outcome", "seconds", "detail") if k in r}
                          for r in ended.values() if r["outcome"] != "passed"],
           "passed": [t for t, r in ended.items() if r["outcome"] == "passed"]}
    unfinished = [t for t in started if t not in ended]
    if unfinished:
        out["running_when_stopped"] = unfinished[-1]
    return out


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"stage": "quick", "parts": [], "skipped": []}


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def _files(paths: list[str]) -> dict:
    """The benchmark JSONs a part wrote: their names, and whether each says it is complete."""
    out = {}
    for p in paths:
        path = Path(p)
        if not path.exists():
            out[path.name] = "not written"
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            out[path.name] = "unreadable"
            continue
        entry = out[path.name] = {"written": True}
        if isinstance(data, dict) and "complete" in data:
            entry["complete"] = data["complete"]
        if isinstance(data, dict) and isinstance(data.get("results"), list):
            rows = data["results"]
            entry.update(cells=len(rows), errors=sum("error" in r for r in rows),
                                  not_identical=sum(r.get("tokens_identical") is False for r in rows))
    return out


def main(argv: list[str]) -> int:
    command, report_path = argv[0], Path(argv[1])
    report = _load(report_path)
    if command == "part":
        name, what, budget, timeout, seconds, rc = argv[2:8]
        rc = int(rc)
        part = {"name": name, "what": what, "budget_s": int(budget), "timeout_s": int(timeout),
                "seconds": int(seconds), "exit_code": rc, "timed_out": rc in (124, 137)}
        rest = argv[8:]
        progress = rest[0] if rest and rest[0].endswith(".jsonl") else None
        part.update(read_progress(progress))
        files = [p for p in rest if not p.endswith(".jsonl")]
        if files:
            part["files"] = _files(files)
        part.pop("passed", None)
        report["parts"].append(part)
        counts = part.get("tests")
        print(f"part {name}: exit {rc}{' (timed out)' if part['timed_out'] else ''} after {seconds} s"
              f" of {timeout} s{f'; tests {counts}' if counts else ''}"
              f"{'; running when stopped: ' + part['running_when_stopped'] if 'running_when_stopped' in part else ''}")
        if counts and not counts["passed"] and counts["skipped"]:
            part["warning"] = "every test skipped: nothing was verified (see not_passed for the reasons)"
            print(f"part {name}: WARNING: {part['warning']}")
    elif command == "skip":
        name, what, reason = argv[2:5]
        report["skipped"].append({"name": name, "what": what, "reason": reason})
    elif command == "finish":
        report.update(exit_code=int(argv[2]), seconds=int(argv[3]), complete=True)
    elif command == "start":
        report = {"stage": "quick", "mode": argv[2], "device": argv[3], "budget_s": int(argv[4]),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "complete": False, "parts": [], "skipped": []}
    else:
        print(f"unknown command {command!r}", file=sys.stderr)
        return 2
    _write(report_path, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

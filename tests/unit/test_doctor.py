"""``hf_vkv.doctor`` in process: the checks on this machine, a simulated failure, a crashing
check, the formatting, the JSON and the exit status (that importing the doctor loads nothing of
CUDA is checked with the package's other imports in ``test_structure.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_vkv import doctor
from hf_vkv.doctor import CHECKS, SIMULATE_ENV, Check, doctor_exit_code, doctor_to_dict, format_checks, run_checks


def test_every_check_passes_or_warns_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    checks = run_checks()
    assert [c.name for c in checks] == [name for name, _ in CHECKS]
    assert all(c.status in ("ok", "warn") for c in checks), format_checks(checks)
    assert doctor_exit_code(checks) == 0
    by_name = {c.name: c for c in checks}
    layout, page = doctor.default_layout_and_page("cpu")
    assert by_name["host backend"].status == "ok" and f"chose {layout}" in by_name["host backend"].detail
    limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    assert by_name["vm.max_map_count"].detail.startswith(f"{limit:,} (")
    if not __import__("torch").cuda.is_available():
        assert by_name["cuda"].status == "ok" and "the host backend serves CPU models" in by_name["cuda"].detail


def test_a_simulated_failure_fails_that_check_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIMULATE_ENV, "host backend, torch")
    checks = run_checks()
    failed = [c.name for c in checks if c.status == "fail"]
    assert failed == ["host backend", "torch"]
    assert doctor_exit_code(checks) == 1
    text = format_checks(checks)
    assert "FAIL  host backend" in text and f"fix: unset {SIMULATE_ENV}" in text
    assert text.splitlines()[-1] == "verdict: NOT READY: host backend, torch failed (exit status 1)"


def test_a_simulated_name_no_check_has_fails_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt name simulated nothing and the verdict said vkv runs: now it is a failed line
    naming the checks."""
    monkeypatch.setenv(SIMULATE_ENV, "hots backend")
    checks = run_checks((("platform", doctor.check_platform),))
    assert [c.name for c in checks] == [SIMULATE_ENV, "platform"]
    assert checks[0].status == "fail" and "'hots backend'" in checks[0].detail and "'platform'" in checks[0].fix
    assert checks[1].status == "ok" and doctor_exit_code(checks) == 1


def test_a_crashing_check_is_a_failure_and_the_others_still_run() -> None:
    def broken() -> Check:
        raise OSError("no such file")

    checks = run_checks((("broken", broken), ("platform", doctor.check_platform)))
    assert checks[0] == Check("broken", "fail", "OSError: no such file",
                              fix="report this as a bug with `hf-vkv doctor --json` attached")
    assert checks[1].name == "platform" and checks[1].status == "ok"


def test_version_outside_the_supported_range_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_dist_version", lambda name: "4.40.0")
    check = doctor.check_transformers()
    assert check.status == "fail" and "outside the supported range" in check.detail
    assert check.fix is not None and check.fix.startswith("pip install 'transformers")


def test_a_small_map_limit_warns_with_the_sysctl_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_read_int", lambda path: 1000)
    monkeypatch.setattr(doctor, "_own_mappings", lambda: 900)
    check = doctor.check_map_count()
    assert check.status == "warn" and "1,000 (900 used by this process)" in check.detail
    assert check.fix is not None and "sysctl -w vm.max_map_count" in check.fix


def test_json_and_warn_formatting() -> None:
    checks = [Check("a", "ok", "fine"), Check("b", "warn", "limited", fix="do x")]
    assert doctor_exit_code(checks) == 0
    assert format_checks(checks).splitlines()[-1] == "verdict: vkv runs here (1 warning)"
    data = json.loads(json.dumps(doctor_to_dict(checks)))
    assert data == {"schema": "hf_vkv.doctor/1", "ok": True, "checks": [
        {"name": "a", "status": "ok", "detail": "fine", "fix": None},
        {"name": "b", "status": "warn", "detail": "limited", "fix": "do x"}]}


@pytest.mark.slow  # a fresh interpreter: 13-23 s on a loaded 2-core machine
class _FakeCu:
    """The two driver calls the doctor makes itself, as ``cuda.bindings.driver`` returns them."""

    class CUdevice_attribute:  # noqa: N801
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102

    def __init__(self, vmm: int) -> None:
        self.vmm = vmm

    def cuDeviceGet(self, index: int) -> tuple[int, int]:  # noqa: N802
        return 0, index

    def cuDeviceGetAttribute(self, attr: int, device: int) -> tuple[int, int]:  # noqa: N802
        return 0, self.vmm


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, *, bindings: bool = True, vmm: int = 1) -> None:
    import torch

    import hf_vkv.cuda

    class FakeDriver:
        def __init__(self, index: int) -> None:
            self.cu = _FakeCu(vmm)

        def driver_version(self) -> int:
            return 13000

        def granularity(self) -> int:
            return 2 << 20

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake H100")
    monkeypatch.setattr(doctor, "_has_cuda_bindings", lambda: bindings)
    monkeypatch.setattr(hf_vkv.cuda, "Driver", FakeDriver)


def test_cuda_with_vmm_is_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch)
    check = doctor.check_cuda()
    assert check.status == "ok", check
    assert check.detail.startswith("Fake H100: driver CUDA 13.0") and "granularity 2 MiB" in check.detail


def test_cuda_without_vmm_or_bindings_fails_with_a_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, vmm=0)
    check = doctor.check_cuda()
    assert check.status == "fail" and "does not support virtual memory management" in check.detail
    _fake_gpu(monkeypatch, bindings=False)
    check = doctor.check_cuda()
    assert check.status == "fail" and check.fix == "pip install 'hf_vkv[cuda]'"


def test_doctor_states_the_cpu_budget_and_the_mapping_budget():
    """The CPU default budget (a share of MemAvailable) and the mapping budget."""
    from hf_vkv.devices import default_host_budget

    check = doctor.check_host_budget()
    assert check.status == "ok" and "of MemAvailable" in check.detail and "budget_bytes" in check.detail
    assert doctor._size(default_host_budget()) in check.detail
    maps = doctor.check_map_count()
    assert "vkv may map" in maps.detail and "left as headroom" in maps.detail
    assert any(name == "cpu budget" for name, _ in doctor.CHECKS)


def test_the_rows_the_doctor_gives_head_major_are_those_the_layout_rule_keeps_head_major() -> None:
    """The doctor counted 2 mappings per sub-row (<= 179 rows) where the layout rule counts the
    measured 3 and 4 rows' worth per shared prompt (103 rows at the default limit)."""
    import re

    from hf_vkv.devices import Workload, choose_layout

    detail = doctor.check_map_count().detail
    rows = int(re.search(r"serves up to ([\d,]+) sampled rows", detail).group(1).replace(",", ""))

    def layout(n: int) -> str | None:
        return choose_layout(None, Workload(device_type="cpu", rows=n, subrows=doctor._DEFAULT_MODEL_SUBROWS,
                                            prompt_repeats=n))

    assert rows >= 1 and layout(rows) == "head_major" and layout(rows + 1) == "token_major", detail

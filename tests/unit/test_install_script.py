"""``scripts/install.sh`` installs the torch build the docs say: the CUDA build where an NVIDIA
driver answers, the CPU build everywhere else, nothing over an installed torch. Run with a fake
``python`` that records its arguments (and a fake ``nvidia-smi``), so nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _run(tmp_path: Path, *, gpu: bool, torch_installed: bool, cpu_index_fails: bool = False) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                    f'case "$*" in "-c import torch") exit {0 if torch_installed else 1};; esac\n'
                    + (f'case "$*" in *{CPU_INDEX}*) exit 1;; esac\n' if cpu_index_fails else "") + 'exit 0\n')
    fake.chmod(0o755)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
        smi.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(fake), "HOME": str(tmp_path)}
    subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], env=env, check=True, timeout=60)
    return [line for line in log.read_text().splitlines() if "torch==" in line]


@pytest.mark.skipif(os.path.exists("/usr/bin/nvidia-smi"), reason="a real nvidia-smi is on /usr/bin")
@pytest.mark.parametrize("gpu", [False, True])
def test_torch_build_follows_the_driver(tmp_path: Path, gpu: bool) -> None:
    calls = _run(tmp_path, gpu=gpu, torch_installed=False)
    assert len(calls) == 1 and "torch==2.13.0" in calls[0]
    assert (CPU_INDEX in calls[0]) is not gpu, calls
    guide = (ROOT / "docs" / "getting_started.md").read_text()
    assert "the CUDA build where an NVIDIA driver answers" in guide and "the CPU build" in guide


def test_an_installed_torch_is_left_alone(tmp_path: Path) -> None:
    assert _run(tmp_path, gpu=False, torch_installed=True) == []


@pytest.mark.skipif(os.path.exists("/usr/bin/nvidia-smi"), reason="a real nvidia-smi is on /usr/bin")
def test_an_unreachable_cpu_index_falls_back_to_the_default_index(tmp_path: Path) -> None:
    first, second = _run(tmp_path, gpu=False, torch_installed=False, cpu_index_fails=True)
    assert CPU_INDEX in first and "--retries 0" in first  # asked once, without pip's retry loop
    assert "torch==2.13.0" in second and "--index-url" not in second

"""Row-exactness proofs kept on disk (``hf_vkv.generate.proof_file``): a verdict proved in one
process is found by the next without proving again, under a key that is the same in every process
and holds what the kernel depends on; a damaged or unwritable file only means proving again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_vkv.generate.proof_file as pf
import hf_vkv.generate.row_exactness as rx

ROOT = Path(__file__).resolve().parents[2]


def _linear_mode(x: torch.Tensor, weight: torch.Tensor, prompts: int, k: int) -> tuple[torch.Tensor, rx.RowExactness]:
    mode = rx.RowExactness(prompts=prompts, repeats=k)
    mode.watching = True
    with mode:
        y = torch.nn.functional.linear(x, weight)
    return y, mode


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "proofs.jsonl"
    monkeypatch.setenv(pf.ENV_VAR, str(path))
    rx.clear_verdicts()
    yield path
    rx.clear_verdicts()
    pf._FILES.pop(path, None)


def test_a_verdict_is_found_again_without_a_proof(kept: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g)
    weight = torch.nn.Parameter(torch.randn(96, 64, generator=g), requires_grad=False)
    y, mode = _linear_mode(x, weight, 1, 4)
    assert mode.counts.probed == 1
    lines = [json.loads(line) for line in kept.read_text().splitlines()]
    assert len(lines) == 1 and rx.verdict_repeats(lines[0]["verdict"], 4) is not None and len(lines[0]["key"]) == 64
    rx.clear_verdicts()
    pf._FILES.pop(kept)  # as a new process would: read from the file
    y_again, mode = _linear_mode(torch.randn(7, 64, generator=g), weight, 1, 4)  # other values, same signature
    assert mode.counts.probed == 0
    # another signature (more rows, other repeats) is proved, and kept beside the first
    _, mode = _linear_mode(torch.randn(9, 64, generator=g), weight, 1, 4)
    assert mode.counts.probed == 1 and len(kept.read_text().splitlines()) == 2


def test_the_key_is_the_same_in_another_process(kept: Path) -> None:
    """A child process proves a signature; this one finds it (a process-randomized hash in the key
    would make every process prove again)."""
    code = ("import torch, hf_vkv.generate.row_exactness as rx\n"
            "torch.set_num_threads(1)\n"
            "w = torch.nn.Parameter(torch.ones(32, 48), requires_grad=False)\n"
            "m = rx.RowExactness(prompts=1, repeats=3); m.watching = True\n"
            "mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)\n"
            "with m:\n"
            "    torch.nn.functional.linear(torch.randn(5, 48), w)\n"
            "    torch.nn.functional.scaled_dot_product_attention(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),"
            " torch.randn(1, 2, 5, 8), attn_mask=mask)\n"
            "print(m.counts.probed)\n")
    env = {**os.environ, pf.ENV_VAR: str(kept), "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[-1] == "2"
    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.full((32, 48), 2.0), requires_grad=False)
    mode = rx.RowExactness(prompts=1, repeats=3)
    mode.watching = True
    with mode:
        torch.nn.functional.linear(torch.randn(5, 48), w)
        # the kept mask's values are in the key: the same mask is found, another one is proved
        torch.nn.functional.scaled_dot_product_attention(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                                         torch.randn(1, 2, 5, 8),
                                                         attn_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool))
        assert mode.counts.probed == 0
        torch.nn.functional.scaled_dot_product_attention(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                                         torch.randn(1, 2, 5, 8),
                                                         attn_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool).tril())
    assert mode.counts.probed == 1


def test_the_key_holds_threads_rows_and_the_environment(kept: Path) -> None:
    weight = torch.nn.Parameter(torch.randn(16, 32), requires_grad=False)
    keys = set()
    for threads, prompts, k in [(1, 1, 2), (2, 1, 2), (1, 1, 3), (1, 2, 2)]:
        torch.set_num_threads(threads)
        rx.clear_verdicts()
        _linear_mode(torch.randn(2 * prompts, 32), weight, prompts, k)
        keys.add(kept.read_text().splitlines()[-1])
    assert len(keys) == 4
    assert torch.__version__ in pf.environment()


def test_a_damaged_or_unwritable_file_only_means_proving_again(kept: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.nn.Parameter(torch.randn(16, 32), requires_grad=False)
    _linear_mode(torch.randn(3, 32), weight, 1, 2)
    key = json.loads(kept.read_text())["key"]
    kept.write_text('{"key": "' + key + '", "verdict": "maybe"}\n{"key": 3\nnot json\n')  # torn and foreign lines
    pf._FILES.pop(kept)
    rx.clear_verdicts()
    _, mode = _linear_mode(torch.randn(3, 32), weight, 1, 2)
    assert mode.counts.probed == 1  # no verdict was taken from the damaged lines
    assert json.loads(kept.read_text().splitlines()[-1])["key"] == key  # and the proof was kept again
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(pf.ENV_VAR, str(blocked / "proofs.jsonl"))  # its folder is a file: cannot be written
    rx.clear_verdicts()
    y, mode = _linear_mode(torch.randn(3, 32), weight, 1, 2)
    assert mode.counts.probed == 1 and y.shape == (3, 16)


def test_off_keeps_proofs_in_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("off", "0", ""):
        monkeypatch.setenv(pf.ENV_VAR, value)
        assert pf.proof_file() is None
    monkeypatch.delenv(pf.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-cache")
    assert pf.proof_file().path == Path("/nonexistent-cache/hf_vkv/row_proofs.jsonl")


def test_a_verdict_of_a_few_repeats_is_kept_and_others_are_not(kept: Path) -> None:
    """``repeats:<m>`` (a call proved on ``m`` repeats of each prompt) is kept and read back like
    ``exact`` and ``expanded``; a malformed one is neither written nor read."""
    file = pf.proof_file()
    for verdict in ("repeats:2", "repeats:1", "repeats:x", "repeats:", "maybe"):
        file.put(f"key-{verdict}", verdict)
    assert [json.loads(line)["verdict"] for line in kept.read_text().splitlines()] == ["repeats:2"]
    with open(kept, "a") as f:
        f.write('{"key": "other", "verdict": "repeats:0"}\n')
    pf._FILES.pop(kept)
    again = pf.proof_file()
    assert again.get("key-repeats:2") == "repeats:2" and again.get("other") is None

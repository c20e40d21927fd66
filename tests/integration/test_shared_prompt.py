"""The shared-prompt benchmark on a tiny random Llama, end to end: every column and
ratio in valid JSON, tokens checked against DynamicCache, the cascade column present or skipped
with a reason, DynamicCache skipped past a limit; and the demo's rows carry TTFT and decode step.
No timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from models import tiny, tokenizer
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from hf_vkv.ab import shared_prompt as sp
from hf_vkv.ab.bench_args import add_shared_prompt_arguments, run_shared_from_args, shared_grid_from_args
from hf_vkv.ab.demo import DemoCase, demo_to_dict, run_demo
from hf_vkv.ab.table import format_times

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_shared_prompt_arguments(parser, standalone=True)
    return parser.parse_args(list(argv))


def test_benchmark_writes_every_column_as_json(model, tmp_path: Path) -> None:
    args = _args("--prompts", "9", "--rounds", "2", "--new-tokens", "3")
    grid = shared_grid_from_args(args)
    assert grid.prompt_lengths == (9,) and grid.workloads == sp.WORKLOADS and grid.caches == sp.CACHES
    out = tmp_path / "sp.json"
    assert run_shared_from_args(args, model, grid=grid, model_name="tiny", command="test", json_path=out) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == sp.SHARED_PROMPT_SCHEMA_VERSION and data["command"] == "test"
    assert data["method"] == sp.METHOD and "load_average_at_start" in data["environment"]
    assert data["cascade_available"] == sp.cascade_attention_available()
    assert [(c["prompt"], c["workload"], c["rows"]) for c in data["cells"]] == [(9, "sample8", 8), (9, "beam4", 4),
                                                                               (9, "greedy", 1)]
    for cell in data["cells"]:
        ran = [n for n in sp.CACHES if n not in cell["skipped"]]
        assert list(cell["caches"]) == ran and {"dynamic", "vkv", "ideal"} <= set(ran)
        for name, col in cell["caches"].items():
            assert len(col["round_ttft_s"]) == len(col["round_decode_step_ms"]) == 2
            assert col["ttft_s"] > 0 and col["decode_step_ms"] > 0
        assert cell["reference"] == "dynamic" and cell["caches"]["vkv"]["tokens_identical"]
        assert cell["caches"]["vkv"]["max_abs_logit_diff"] == 0.0 and cell["caches"]["vkv"]["token_agreement"] == 1.0
        if cell["rows"] > 1:
            assert cell["caches"]["vkv"]["vkv_stats"]["prefill_once"].startswith("on")
        assert cell["ratios"]["vkv/dynamic"]["ttft"] > 0 and cell["ratios"]["vkv/ideal"]["decode_step"] > 0
        if "vkv_cascade" in cell["skipped"]:
            assert "not registered" in cell["skipped"]["vkv_cascade"]
    assert "TTFT v/d" in sp.format_shared_prompt(data["cells"])


def test_cascade_column_runs_when_the_name_is_registered(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in "vkv_cascade" (plain SDPA) where the real one is not registered yet: the column runs
    and is compared with DynamicCache."""
    if not sp.cascade_attention_available():
        monkeypatch.setitem(AttentionInterface._global_mapping, sp.CASCADE_ATTENTION, sdpa_attention_forward)
        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, sp.CASCADE_ATTENTION, sdpa_mask)
    before = model.config._attn_implementation
    grid = sp.SharedPromptGrid(prompt_lengths=(7,), workloads=("beam4",), decode_steps=2, rounds=1)
    (cell,) = sp.run_shared_prompt(model, grid)
    assert model.config._attn_implementation == before  # restored
    casc = cell["caches"]["vkv_cascade"]
    assert "vkv_cascade" not in cell["skipped"] and casc["tokens_identical"] is not None
    assert casc["max_abs_logit_diff"] is not None and cell["ratios"]["vkv_cascade/dynamic"]["ttft"] > 0
    # the cache was built for the cascade (a cache built before the switch would say "not asked")
    assert casc["vkv_stats"]["cascade"] != "not asked"
    assert cell["caches"]["vkv"]["vkv_stats"]["cascade"] == "not asked"


def test_dynamic_cache_is_skipped_past_the_limit(model) -> None:
    grid = sp.SharedPromptGrid(prompt_lengths=(6,), workloads=("sample8",), decode_steps=2, rounds=2,
                               caches=("dynamic", "vkv", "ideal"), dynamic_limit_s=1e-9)
    (cell,) = sp.run_shared_prompt(model, grid)
    assert "dynamic" not in cell["caches"] and "> limit" in cell["skipped"]["dynamic"]
    assert cell["reference"] == "vkv" and cell["caches"]["ideal"]["tokens_identical"] is not None
    assert cell["ratios"]["vkv/dynamic"]["ttft"] is None and cell["ttft_target_met"] is None


def test_grid_rejects_bad_values() -> None:
    for bad in ({"caches": ("vkv",)}, {"workloads": ("beam1",)}, {"workloads": ("sample08",)}, {"workloads": ("x4",)},
                {"workloads": ()}, {"rounds": 0}, {"prompt_lengths": (1,)}, {"dynamic_limit_s": 0}):
        with pytest.raises(ValueError):
            sp.SharedPromptGrid(**bad)
    assert sp.SharedPromptGrid(workloads=("beam8", "sample64", "greedy")).workloads[1] == "sample64"  # the scaling grid's
    args = _args()
    assert shared_grid_from_args(args).prompt_lengths == sp.DEFAULT_PROMPTS


def test_demo_rows_carry_ttft_and_decode_step(model) -> None:
    cases = (DemoCase("n=8 sampling, document", "document", {"do_sample": True, "num_return_sequences": 8}),
             DemoCase("4 beams, document", "document", {"do_sample": False, "num_beams": 4}))
    tok = tokenizer()
    rows = run_demo(model, tok, max_new_tokens=3, cases=cases, document_tokens=12, progress=False)
    data = demo_to_dict(rows, wall_s=1.0, environment={})
    for run in data["runs"]:
        for cache in ("dynamic", "vkv"):
            assert run["ttft_s"][cache] > 0 and run["decode_step_s"][cache] > 0
        assert run["ttft_ratio_vs_dynamic"] > 0 and run["decode_ratio_vs_dynamic"] > 0
        assert run["vkv_stats"]["prefill_once"].startswith("on") and run["vkv_stats"]["prompt_tokens_saved"] > 0
    table = format_times([(row.case.label, row.report) for row in rows]).splitlines()
    assert "TTFT dyn" in table[0] and "KV vkv" in table[0] and len(table) == 2 + len(cases)


def test_hf_vkv_bench_runs_the_shared_prompt_grid(model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_vkv.cli import main

    model.save_pretrained(tmp_path / "tiny")
    tokenizer().save_pretrained(tmp_path / "tiny")
    code = main(["bench", "--shared-prompt", "--model", str(tmp_path / "tiny"), "--prompt-lengths", "6",
                 "--workloads", "greedy", "--new-tokens", "2", "--rounds", "1", "--json", str(tmp_path / "b.json")])
    assert code == 0 and "TTFT v/d" in capsys.readouterr().out
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["schema"] == sp.SHARED_PROMPT_SCHEMA_VERSION and data["command"].startswith("hf-vkv")
    assert [(c["prompt"], c["workload"]) for c in data["cells"]] == [(6, "greedy")]


def test_hf_vkv_demo_prints_time_beside_memory(model, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``hf-vkv demo``'s tables on the tiny model (the embedded one takes minutes: tests/integration/test_cli.py)."""
    from hf_vkv import cli

    monkeypatch.setattr(cli, "_load", lambda name, parser, quiet=False: (model, tokenizer()))
    assert cli.main(["demo", "--max-new-tokens", "2", "--document-tokens", "8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "Time beside memory" in out
    lines = out[out.index("Time beside memory"):].splitlines()
    assert "TTFT dyn" in lines[1] and "KV vkv" in lines[1]
    assert [line.split()[0] for line in lines[3:6]] == ["n=8", "4", "greedy,"]


def test_caches_of_a_prompt_copy_per_row_are_skipped_beyond_memory(model) -> None:
    """DynamicCache and the ideal hold the prompt once per row: a cell whose copies exceed the
    memory available skips them before they start (recorded), and vkv's reference becomes vkv."""
    assert sp._beyond_memory(model, 1, 6, 2) is None
    why = sp._beyond_memory(model, 10**9, 4096, 2)  # ~10^9 rows of 4k tokens: more than any machine has
    assert why is not None and why.startswith("not enough memory") and "GiB available" in why
    huge = sp.SharedPromptGrid(prompt_lengths=(6,), workloads=("sample8",), decode_steps=2, rounds=1,
                               caches=("dynamic", "vkv", "ideal"))
    real = sp._beyond_memory
    try:
        sp._beyond_memory = lambda m, rows, prompt, steps: real(m, rows * 10**9, 4096, steps)
        (cell,) = sp.run_shared_prompt(model, huge)
    finally:
        sp._beyond_memory = real
    assert set(cell["caches"]) == {"vkv"} and cell["reference"] == "vkv"
    assert all(cell["skipped"][n].startswith("not enough memory") for n in ("dynamic", "ideal"))

"""The ``hf-vkv`` help and the docs (``docs/cli.md``, ``docs/usage.md``) say the same things: exit statuses, the bench grids, a help
text and default for every ``ab`` option, ``map_ahead`` in the options table; ``ab --json -``
means stdout, as ``demo --json -`` does."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import pytest
from test_cli import model_dir, run_main  # noqa: F401  (the module fixture)

from hf_vkv import cli
from hf_vkv.ab.bench import FULL_GRID, QUICK_GRID
from hf_vkv.cache import CacheOptions

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs"
CLI_PAGE = (DOCS / "cli.md").read_text()
USAGE_PAGE = (DOCS / "usage.md").read_text()


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_top_level_help_names_every_exit_status() -> None:
    text = cli._parser().format_help()
    for status, meaning in ((0, "identical"), (1, "diverged"), (2, "usage error"), (3, "refused")):
        assert f"{status} " in text and meaning in text, (status, text)
    assert "3 when vkv refused the run" in CLI_PAGE


def test_every_ab_option_has_help_and_shows_its_default() -> None:
    for action in _subparser("ab")._actions:
        if action.dest == "help":
            continue
        assert action.help, f"ab {action.option_strings} has no help"
        if action.default not in (None, False) and action.default is not argparse.SUPPRESS:
            assert "%(default)s" in action.help or "default" in action.help, f"ab {action.option_strings}: no default"


def _grid_words(grid: object) -> str:
    return (f"prompts {'/'.join(map(str, grid.prompt_lengths))}, batches {'/'.join(map(str, grid.batches))}, "
            f"{grid.new_tokens} new tokens")


def test_readme_states_the_bench_grids_of_the_help() -> None:
    for grid in (QUICK_GRID, FULL_GRID):
        assert _grid_words(grid) in CLI_PAGE, _grid_words(grid)
        assert f"prompts {' '.join(map(str, grid.prompt_lengths))}" in _subparser("bench").format_help().replace("\n", " ").replace("  ", " ")


def test_readme_options_table_lists_every_cache_option() -> None:
    for f in fields(CacheOptions):
        assert f"| `{f.name}` |" in USAGE_PAGE, f"cache_config key {f.name!r} missing from docs/usage.md's options table"


def test_the_cli_reference_names_every_subcommand_and_option() -> None:
    """docs/cli.md against the parser: a new subcommand or option fails here until it is documented."""
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"`{name}" in CLI_PAGE, f"hf-vkv {name} is missing from docs/cli.md"
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in CLI_PAGE, f"hf-vkv {name} {option} is missing from docs/cli.md"


def test_the_cli_reference_gives_each_subcommands_help_line() -> None:
    """``hf-vkv --help``'s one line for each subcommand is the source: docs/cli.md's row for it says
    it word for word (and may say more), so the two cannot describe a subcommand differently."""
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    page = " ".join(CLI_PAGE.split())
    for choice in sub._choices_actions:
        line = " ".join(choice.help.split())
        row = next((r for r in page.split(" | `")[1:] if r.startswith(choice.dest + " ") or
                    r.startswith(choice.dest + "`")), None)
        assert row is not None, f"docs/cli.md has no table row for hf-vkv {choice.dest}"
        assert line in row, f"docs/cli.md's row for hf-vkv {choice.dest} does not say its help line: {line!r}"


def test_ab_json_dash_is_stdout(model_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path,  # noqa: F811
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_main(capsys, "ab", "--model", model_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "3",
                            "--json", "-", "--quiet", "--threads", "1")
    assert code == 0
    data = json.loads(out)  # stdout holds the JSON and nothing else
    assert data["identical"] and len(data["steps"]) == 3
    assert not (tmp_path / "-").exists()

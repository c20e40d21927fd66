"""The command line of the benchmark, shared by ``hf-vkv bench`` and ``benchmarks/generate_cpu.py``.

Both add the same options with :func:`add_arguments` (they differ only in their default grid),
load their model, and call :func:`run_from_args`, which runs :mod:`.bench`, prints the tables
and writes the JSON. The shared-prompt benchmark (:mod:`.shared_prompt`; ``hf-vkv bench
--shared-prompt`` and ``benchmarks/shared_prompt.py``) has :func:`add_shared_prompt_arguments`,
:func:`shared_grid_from_args` and :func:`run_shared_from_args` the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from transformers import PreTrainedModel

from .bench import (
    CACHES, FULL_GRID, MODES, QUICK_GRID, Grid, all_identical, bench_report, default_layout, format_cells, format_modes,
    run_cells, run_modes,
)
from .harness import describe_environment
from .shared_prompt import CACHES as SHARED_CACHES
from .shared_prompt import (
    DEFAULT_PROMPTS, WORKLOADS, SharedPromptGrid, format_shared_prompt, run_shared_prompt, shared_prompt_report,
)

__all__ = ["add_arguments", "add_shared_prompt_arguments", "grid_from_args", "int_at_least", "run_from_args",
           "run_shared_from_args", "script_main", "shared_grid_from_args"]


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an int ``>= low``, else a usage error naming the option (an explicit 0
    or negative count is refused, never taken for the option's default)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _describe(grid: Grid) -> str:
    return (f"prompts {' '.join(map(str, grid.prompt_lengths))}, batches {' '.join(map(str, grid.batches))}, "
            f"{grid.new_tokens} new tokens, {grid.rounds} rounds")


def add_arguments(parser: argparse.ArgumentParser, *, default: Literal["quick", "full"]) -> None:
    """The grid options (``--quick`` / ``--full`` and overrides), ``--json`` and ``--threads``."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", dest="grid", action="store_const", const="quick", default=default,
                       help=f"the quick grid: {_describe(QUICK_GRID)}" + (" (default)" if default == "quick" else ""))
    which.add_argument("--full", dest="grid", action="store_const", const="full",
                       help=f"the full grid: {_describe(FULL_GRID)}" + (" (default)" if default == "full" else ""))
    parser.add_argument("--prompt-lengths", "--prompts", type=int, nargs="+", default=None, metavar="N")
    parser.add_argument("--batches", type=int, nargs="+", default=None, metavar="N")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per cell (the median is reported)")
    parser.add_argument("--caches", nargs="+", default=None, choices=CACHES,
                        help="caches of the decode cells (default: %s)" % " ".join(QUICK_GRID.caches))
    parser.add_argument("--modes", nargs="*", default=None, choices=tuple(MODES),
                        help="also A/B generate() with DynamicCache and vkv in these modes (default: none)")
    parser.add_argument("--distinct-tokens", type=int, default=None,
                        help=f"prefill budget: distinct prompts per cell = tokens // prompt "
                             f"(default {QUICK_GRID.distinct_tokens})")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the generate modes")
    parser.add_argument("--threads", type=int_at_least(1), default=None,
                        help="torch threads of the prefill and the generate modes (default: torch's); the "
                             "timed decode steps always run on one intra-op thread")


def grid_from_args(args: argparse.Namespace) -> Grid:
    """The grid chosen by ``--quick`` / ``--full`` with the overrides applied (``ValueError`` names a bad one)."""
    base = FULL_GRID if args.grid == "full" else QUICK_GRID
    overrides = dict(prompt_lengths=args.prompt_lengths, batches=args.batches, new_tokens=args.new_tokens,
                     rounds=args.rounds, caches=args.caches, modes=args.modes, distinct_tokens=args.distinct_tokens)
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v is not None}
    return Grid(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **given})


def run_from_args(args: argparse.Namespace, model: PreTrainedModel, *, grid: Grid, model_name: str, command: str,
                  json_path: Path) -> int:
    """Run ``grid`` on ``model``, print the tables, write the JSON; 0 when every cache and run
    matched DynamicCache, else 1."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    environment = describe_environment(model, command=command)
    cells = run_cells(model, grid, progress=True)
    modes = run_modes(model, grid, seed=args.seed, progress=True) if grid.modes else []
    report = bench_report(cells, modes, model=model_name, grid=grid, command=command, environment=environment)
    print(f"decode step, ms (median of {grid.rounds} rounds of {grid.new_tokens} steps, {grid.threads} thread(s), "
          f"caches interleaved); ratios: vkv layout / ideal and / DynamicCache, median of the per-round ratios; "
          f"util: stats().utilization; "
          f"target: the default layout ({default_layout()}) <= 1.03 x ideal at prompts >= 512, "
          f">= 0.97 x DynamicCache's speed below")
    print(format_cells(cells))
    if modes:
        print("\ngenerate() A/B, DynamicCache against the default vkv cache")
        print(format_modes(modes))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_path}")
    print(f"environment: {environment}", file=sys.stderr)
    return 0 if all_identical(cells, modes) else 1


# ------------------------------------------------------------------------- shared-prompt grid
def add_shared_prompt_arguments(parser: argparse.ArgumentParser, *, standalone: bool) -> None:
    """The options of the shared-prompt benchmark (:mod:`.shared_prompt`). ``standalone=False``
    (``hf-vkv bench``): ``--shared-prompt`` selects it, and the bench's own ``--prompt-lengths``,
    ``--new-tokens`` (decode steps), ``--rounds``, ``--seed``, ``--threads`` and ``--json`` apply;
    ``standalone=True`` (``benchmarks/shared_prompt.py``): those are added here."""
    if standalone:
        parser.add_argument("--prompt-lengths", "--prompts", type=int, nargs="+", default=None, metavar="N",
                            help=f"default: {' '.join(map(str, DEFAULT_PROMPTS))}")
        parser.add_argument("--new-tokens", "--decode-steps", type=int, default=None,
                            help="decode steps timed per run (default 8)")
        parser.add_argument("--rounds", type=int, default=None, help="rounds per cell (default 3; the median is "
                            "reported)")
        parser.add_argument("--seed", type=int, default=1234, help="seed of every generate")
        parser.add_argument("--threads", type=int_at_least(1), default=None,
                            help="torch threads of the timed runs (default 1)")
    else:
        parser.add_argument("--shared-prompt", action="store_true",
                            help="the shared-prompt grid instead: TTFT and decode step of generate() for "
                                 "n=8 sampling, 4 beams and greedy with DynamicCache, vkv, vkv_cascade and an ideal; "
                                 f"--quick: prompt 512, --full: {' '.join(map(str, DEFAULT_PROMPTS))}")
    parser.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                        help="shared-prompt workloads (default: %s)" % " ".join(WORKLOADS))
    parser.add_argument("--shared-caches", nargs="+", default=None, choices=SHARED_CACHES,
                        help="shared-prompt caches (default: %s; 'dynamic' required)" % " ".join(SHARED_CACHES))
    parser.add_argument("--dynamic-limit-s", type=float, default=None, metavar="S",
                        help="shared-prompt: skip DynamicCache in a cell whose run is estimated (rows x the one-row "
                             "TTFT) to take more than S seconds (default: never skip)")


def shared_grid_from_args(args: argparse.Namespace) -> SharedPromptGrid:
    """The shared-prompt grid of the parsed options (``ValueError`` names a bad one)."""
    prompts = args.prompt_lengths or (DEFAULT_PROMPTS if getattr(args, "grid", "full") == "full" else (512,))
    given = dict(prompt_lengths=tuple(prompts), workloads=args.workloads, decode_steps=args.new_tokens,
                 rounds=args.rounds, caches=args.shared_caches, dynamic_limit_s=args.dynamic_limit_s, seed=args.seed,
                 threads=args.threads)
    return SharedPromptGrid(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None})


def run_shared_from_args(args: argparse.Namespace, model: PreTrainedModel, *, grid: SharedPromptGrid,
                         model_name: str, command: str, json_path: Path) -> int:
    """Run the shared-prompt ``grid``, print its table, write the JSON; 0 when vkv's tokens were
    DynamicCache's in every cell that ran both, else 1."""
    environment = describe_environment(model, command=command)
    environment["load_average_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cells = run_shared_prompt(model, grid, progress=True)
    report = shared_prompt_report(cells, grid=grid, model=model_name, command=command, environment=environment)
    print(f"TTFT (s) and decode step (ms): median of {grid.rounds} rounds, {grid.decode_steps} decode steps per run, "
          f"{grid.threads} thread(s), caches interleaved; v/d, v/i: vkv / DynamicCache, vkv / ideal (median of the "
          f"per-round ratios); casc|dl|: max |dlogit| of vkv_cascade against DynamicCache")
    print(format_shared_prompt(cells))
    for cell in cells:
        for name, why in cell["skipped"].items():
            print(f"skipped at prompt {cell['prompt']} {cell['workload']}: {name}: {why}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_path}")
    return 0 if all(c["caches"].get("vkv", {}).get("tokens_identical") is not False for c in cells) else 1


# ----------------------------------------------------------------------------- the scripts' main
def script_main(argv: list[str] | None, *, doc: str, script: str, add: Callable[[argparse.ArgumentParser], None],
                make_grid: Callable[[argparse.Namespace], Any], run: Callable[..., int], json_default: Path) -> int:
    """The ``main`` of a benchmark script (``benchmarks/generate_cpu.py``, ``benchmarks/shared_prompt.py``):
    its docstring as help, ``add``'s options and ``--json``, the grid (``make_grid``; a bad one is a
    usage error), the embedded SmolLM2 in fp32, then ``run(args, model, grid=, model_name=,
    command=, json_path=)`` (:func:`run_from_args` or :func:`run_shared_from_args`)."""
    import torch

    from ..default_model import load_default_model

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add(parser)
    parser.add_argument("--json", type=Path, default=json_default)
    args = parser.parse_args(argv)
    try:
        grid = make_grid(args)
    except ValueError as e:
        parser.error(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, _ = load_default_model(dtype=torch.float32)
    command = " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    return run(args, model, grid=grid, model_name="SmolLM2-135M-Instruct (embedded, fp32)", command=command,
               json_path=args.json)

"""The ``hf-vkv`` command.

* ``hf-vkv demo``: generate on the embedded SmolLM2 with the vkv cache, print the text, then a
  compact A/B table against DynamicCache (greedy, beam search, sampling).
* ``hf-vkv ab``: one A/B run of your choice (model, prompts, mode, layout), step by step, as a
  table, JSON (``--json``) and a plot of KV memory over the steps (``--plot``).
* ``hf-vkv bench``: the benchmark grid (quick by default, ``--full`` for the whole one), as a table
  and JSON.
* ``hf-vkv doctor``: what this machine gives the cache (:mod:`hf_vkv.doctor`), each line OK or a fix.
* ``hf-vkv chat``: a chat through a prefix store (:mod:`hf_vkv.ab.chat`): each turn's reused tokens
  and time to first token beside DynamicCache's re-prefill of the whole conversation; ``--store
  DIR`` starts from a saved store (mapped) and saves it back.
* ``hf-vkv prefix save | inspect``: a system prompt's KV saved as a mapped prefix store, and what
  a saved folder holds (:mod:`hf_vkv.cli_prefix`).

Output: results on stdout; progress on stderr, as bars on a terminal and one plain line per run
otherwise (:mod:`hf_vkv.ab.progress`); ``--quiet`` leaves only the results; ``--json`` writes
JSON. When vkv refuses a run (out of its budget, an unsupported device or model, no CUDA
bindings) one line says why, through the ``hf_vkv`` logger (transformers' logging).

Exit status: 0 when every A/B run was identical to DynamicCache (tokens, logits and, with the tee,
K/V), 1 when one diverged (doctor: a check failed), 2 for a usage error, 3 when vkv refused to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .ab import ABReport

from .ab.demo_text import SHORT_PROMPT as DEMO_PROMPT
from .ab.records import AttentionPath
from .generate import serving
from .memory.errors import InvariantError, VKVError
from .version import __version__

__all__ = ["DEMO_PROMPT", "EXIT_REFUSED", "exit_code", "main"]

#: Exit status when vkv refused to run (the reason is logged in one line).
EXIT_REFUSED = 3
#: New tokens per row of ``hf-vkv demo`` (chosen by timing the demo on 2 CPU cores).
DEMO_NEW_TOKENS = 16
SIMULATE_HELP = ("To see a failure: HF_VKV_DOCTOR_FAIL='host backend' hf-vkv doctor (a comma-separated list of check "
                 "names; each fails without running).")
#: ``--model`` value that means the embedded SmolLM2-135M-Instruct.
DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (embedded)"


def exit_code(reports: Sequence[ABReport]) -> int:
    """0 when every report passes the A/B against DynamicCache (:attr:`ABReport.passed`), else 1."""
    return 0 if all(r.passed for r in reports) else 1


def _load(name: str, parser: argparse.ArgumentParser, *, quiet: bool = False
          ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``"default"``: the embedded SmolLM2 (float32); otherwise a local model folder with its tokenizer (one
    transformers cannot load, a config that is not JSON say, is a usage error naming it)."""
    import torch

    from .ab.progress import quiet_library_progress

    quiet_library_progress(quiet=quiet)
    if name == DEFAULT_MODEL:
        from .default_model import load_default_model

        if not quiet:
            print("loading the embedded SmolLM2-135M-Instruct (converted once to safetensors, then cached)...",
                  file=sys.stderr, flush=True)
        return load_default_model(dtype=torch.float32)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as exc:  # a config that is not JSON, a damaged weights file (safetensors' own error), ...
        parser.error(f"--model {name}: transformers cannot load it: {type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:300]}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _encode(tok: PreTrainedTokenizerBase, texts: Sequence[str], *, chat: bool) -> dict[str, Any]:
    """Left-padded ``input_ids`` / ``attention_mask`` ``[len(texts), longest]``; with ``chat`` (and a
    chat template), each text is one user message."""
    if chat and getattr(tok, "chat_template", None):
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    tok.padding_side = "left"
    return dict(tok(list(texts), return_tensors="pt", padding=True))


#: What ``--model FOLDER`` must hold for ``_load`` (each: what the message names, file patterns of which one will do).
_MODEL_FOLDER_NEEDS = (
    ("config.json", ("config.json",)),
    ("the weights (*.safetensors or pytorch_model.bin)",
     ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")),
    ("a tokenizer (tokenizer.json or tokenizer_config.json)",
     ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")),
)


def _model_folder_lacks(folder: Path) -> list[str]:
    """What ``folder`` lacks to be loaded as a model with its tokenizer (empty: nothing)."""
    return [what for what, patterns in _MODEL_FOLDER_NEEDS
            if not any(p.is_file() for pattern in patterns for p in folder.glob(pattern))]


def _check_model(name: str, parser: argparse.ArgumentParser) -> None:
    """``--model``: 'default' or a folder holding a model and its tokenizer, checked before anything loads."""
    if name == DEFAULT_MODEL:
        return
    if not Path(name).is_dir():
        parser.error(f"--model {name!r} is neither 'default' nor a local model folder (this tool never downloads: "
                     "save a model and its tokenizer with save_pretrained and pass the folder)")
    lacks = _model_folder_lacks(Path(name))
    if lacks:
        lacking = lacks[0] if len(lacks) == 1 else f"{', '.join(lacks[:-1])} and {lacks[-1]}"
        parser.error(f"--model {name} is not a model folder: it lacks {lacking}; save a model and its "
                     "tokenizer there with save_pretrained (this tool never downloads)")


def _system_text(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """``--system-file``'s text without its final newline (the one an editor or ``echo`` ends a file
    with, which a client sending the same text does not; default: the demo's handbook), read before
    any model loads."""
    from .ab.demo_text import DOCUMENT

    if not args.system_file:
        return DOCUMENT
    try:
        return Path(args.system_file).read_text(encoding="utf-8").removesuffix("\n")
    except OSError as e:
        parser.error(f"--system-file: cannot read {args.system_file}: {e.strerror or e}")
    except UnicodeDecodeError as e:
        parser.error(f"--system-file: {args.system_file} is not UTF-8 text (byte {e.start}: {e.reason})")


def _check_folder(path: str | None, option: str, parser: argparse.ArgumentParser) -> None:
    """A folder the command writes a prefix store into: refused before any work where a file is
    there, or above it."""
    if path is None:
        return
    if Path(path).exists() and not Path(path).is_dir():
        parser.error(f"{option} {path} is a file, not a folder: name a folder (new, or one PrefixStore.save wrote)")
    above = _file_above(Path(path))
    if above is not None:
        parser.error(f"{option} {path}: {above} is a file, so no folder can be made under it: name another folder")


def _file_above(path: Path) -> Path | None:
    """The file that the nearest existing path above ``path`` is, if it is one (nothing can be made under it)."""
    above = next((p for p in path.parents if p.exists()), None)
    return above if above is not None and not above.is_dir() else None


def _plot_suffixes() -> tuple[str, ...]:
    """The file suffixes ``--plot`` can write: matplotlib's (it picks the format by the suffix)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # plot_report says how to install it
        return (".png",)
    return tuple(sorted(f".{kind}" for kind in FigureCanvasBase.get_supported_filetypes()))


def _check_outputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--json OUT`` and ``--plot OUT``: a usage error before any work where ``OUT`` cannot be a file
    written there (a folder, or a path under a file) or a plot of that suffix, not a traceback
    after the command ran."""
    for option, example in (("json", "out.json"), ("plot", "out.png")):
        path = getattr(args, option, None)
        if not isinstance(path, (str, Path)) or (option == "json" and str(path) == "-"):  # JSON to stdout
            continue
        out = Path(path)
        if out.is_dir():
            parser.error(f"--{option} {path} is a folder: name a file (e.g. {out / example})")
        above = _file_above(out)
        if above is not None:
            parser.error(f"--{option} {path}: {above} is a file, so nothing can be written under it: name another path")
        if option == "plot" and out.suffix.lower() not in _plot_suffixes():
            parser.error(f"--plot {path}: a plot is written as {', '.join(_plot_suffixes())}: name such a file "
                         f"(e.g. {out.with_suffix('.png')})")


def _pad_id(tok: PreTrainedTokenizerBase) -> int | None:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _check_chat_template(tokenizer: Any, model: str, parser: argparse.ArgumentParser) -> None:
    """A usage error where the model's tokenizer has no chat template (``chat`` and ``prefix save``
    render conversations with it; ``ab`` takes raw prompts)."""
    if not getattr(tokenizer, "chat_template", None):
        parser.error(f"--model {model}: its tokenizer has no chat template (tokenizer.chat_template), which chat and "
                     f"prefix save render conversations with: use a chat model, or `hf-vkv ab` for raw prompts")


def _text_out(args: argparse.Namespace) -> Any:
    """Where a command's text goes: stderr when ``--json -`` puts the JSON on stdout, else stdout."""
    return sys.stderr if getattr(args, "json", None) is not None and str(args.json) == "-" else sys.stdout


def _write_json(target: str | Path, data: dict[str, Any]) -> None:
    """``data`` as JSON to the file ``target`` (``"-"``: stdout)."""
    text = json.dumps(data, indent=2) + "\n"
    if str(target) == "-":
        sys.stdout.write(text)
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)


def _threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------- demo
def _answer(tok: PreTrainedTokenizerBase, report: ABReport, limit: int = 160) -> str:
    text = " ".join(tok.decode(list(report.generated_vkv[0]), skip_special_tokens=True).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The demo (:mod:`hf_vkv.ab.demo`): a ~1k-token document answered with n=8 sampling and 4 beams
    and a short greedy prompt, each an A/B against DynamicCache; the table and where the savings
    come from on stdout."""
    from .ab.demo import demo_to_dict, run_demo
    from .ab.harness import describe_environment
    from .ab.table import format_savings, format_step_spread, format_summary, format_times

    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be >= 2 (a prefill and at least one decode step)")
    if args.document_tokens is not None and args.document_tokens < 1:
        parser.error("--document-tokens must be >= 1")
    t0 = time.perf_counter()
    _threads(args.threads)
    model, tok = _load(DEFAULT_MODEL, parser, quiet=args.quiet)

    def started(case: Any, prompt_tokens: int) -> None:
        if not args.quiet:
            print(f"A/B run: {case.label} ({prompt_tokens}-token prompt) ...", file=sys.stderr, flush=True)

    rows = run_demo(model, tok, max_new_tokens=args.max_new_tokens, document_tokens=args.document_tokens,
                    progress=not args.quiet, on_start=started)
    wall = time.perf_counter() - t0
    env = describe_environment(model)
    if args.json is not None:
        _write_json(args.json, demo_to_dict(rows, wall_s=wall, environment=env))
        if str(args.json) == "-":
            return exit_code([r.report for r in rows])
    if not args.quiet:
        for row in rows:
            print(f"{row.case.label}, vkv, sequence 0: {_answer(tok, row.report)!r}")
        print()
    labelled = [(row.case.label, row.report) for row in rows]
    print(f"A/B against DynamicCache: {DEFAULT_MODEL_NAME}, {env['device']} ({os.cpu_count()} cores, "
          f"{env['torch_threads']} torch threads), {env['dtype']}, {args.max_new_tokens} new tokens per row.")
    print("tokens: tokens and logits equal at every step; KV: peak bytes held (vkv: resident pages, a shared page "
          "counted once); step: mean decode step")
    print(format_summary(labelled, ideal_kv_bytes=[row.ideal_kv_bytes for row in rows]))
    print("\nTime beside memory (TTFT: generate's set-up, prefill and first logits; step: mean decode step):")
    print(format_times(labelled))
    print(format_step_spread(labelled))
    print("\nWhere vkv's memory goes (stats() after generate):")
    print(format_savings([(row.case.label, row.stats) for row in rows]))
    if all(row.ideal_kv_bytes is None for row in rows):
        print("\nvkv/ideal: the ideal cache (hf_vkv.ab.ideal) measures decode speed in 'hf-vkv bench', not memory here.")
    for label, r in labelled:
        if not r.identical:
            where = r.first_divergence.describe() if r.first_divergence else "the returned sequences differ"
            print(f"DIVERGED: {label}: {where}")
    print(f"\ndemo: {wall:.0f} s on this machine, model load included. One run step by step, with JSON and a plot: "
          "hf-vkv ab --model default --mode beam --json ab.json --plot ab.png")
    return exit_code([r for _, r in labelled])


# ------------------------------------------------------------------------------------------- ab
_MODE_KWARGS = {"greedy": {"do_sample": False}, "sample": {"do_sample": True}, "beam": {"do_sample": False}}


def _ab_kwargs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Generation arguments of ``--mode`` / ``--num-beams`` / ``--num-return-sequences``, checked."""
    kwargs: dict[str, Any] = dict(_MODE_KWARGS[args.mode])
    if args.mode == "beam":
        kwargs["num_beams"] = 4 if args.num_beams is None else args.num_beams  # an explicit 0 is refused
        if kwargs["num_beams"] < 2:
            parser.error("--num-beams must be >= 2 with --mode beam")
        if args.num_return_sequences > kwargs["num_beams"]:
            parser.error("--num-return-sequences cannot exceed --num-beams")
    elif args.num_beams not in (None, 1):
        parser.error("--num-beams needs --mode beam")
    if args.num_return_sequences < 1:
        parser.error("--num-return-sequences must be >= 1")
    if args.num_return_sequences > 1:
        if args.mode == "greedy":
            parser.error("greedy decoding returns one sequence per prompt: use --mode sample or --mode beam "
                         "with --num-return-sequences")
        kwargs["num_return_sequences"] = args.num_return_sequences
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    return kwargs


def _prompt_texts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    if args.prompts_file is not None:
        try:
            lines = [line.strip() for line in Path(args.prompts_file).read_text().splitlines()]
        except OSError as e:
            parser.error(f"--prompts-file: cannot read {args.prompts_file}: {e.strerror}")
        except UnicodeDecodeError as e:
            parser.error(f"--prompts-file: {args.prompts_file} is not UTF-8 text (byte {e.start}: {e.reason})")
        texts = [line for line in lines if line]
        if not texts:
            parser.error(f"--prompts-file {args.prompts_file} has no non-empty line (one prompt per line)")
        return texts
    if args.prompt and not all(text.strip() for text in args.prompt):
        parser.error("--prompt is empty: give some text (a prompt needs at least one token)")
    return args.prompt or [DEMO_PROMPT]


def ab(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """One A/B run: table on stdout, optional JSON and plot."""
    from .ab import format_report, paged_attention_available, plot_report, run_ab

    kwargs = _ab_kwargs(args, parser)
    texts = _prompt_texts(args, parser)
    if args.layout == "paged" and not paged_attention_available():
        parser.error("--layout paged needs the 'vkv_paged' attention implementation, which this hf_vkv does not "
                     "register yet; use --layout contiguous")
    if args.reference is not None and not args.reuse:
        parser.error("--reference chooses what --reuse's turns are compared with: give --reuse TURNS")
    _check_model(args.model, parser)
    _threads(args.threads)
    model, tok = _load(args.model, parser, quiet=args.quiet)
    if args.reuse:
        return _ab_reuse(args, parser, model, tok, texts, kwargs)
    inputs = _encode(tok, texts, chat=not args.raw)
    report = run_ab(model, inputs, max_new_tokens=args.max_new_tokens, layout=args.layout, tee=not args.no_tee,
                    seed=args.seed, progress=not args.quiet, pad_token_id=_pad_id(tok), **kwargs)
    if args.model == DEFAULT_MODEL:
        report = dataclasses.replace(report, model=DEFAULT_MODEL_NAME)
    to_stdout = args.json is not None and str(args.json) == "-"
    if to_stdout:  # as demo's: JSON on stdout instead of the table
        sys.stdout.write(report.to_json() + "\n")
    else:
        text = tok.decode(list(report.generated_vkv[0]), skip_special_tokens=True).strip()
        print(f"vkv, sequence 0: {text!r}\n")
        print(format_report(report))
        if args.json is not None:
            print(f"wrote {report.write_json(args.json)}")
    if args.plot is not None:
        print(f"wrote {plot_report(report, args.plot)}", file=sys.stderr if to_stdout else sys.stdout)
    return exit_code([report])


#: The user messages of ``hf-vkv chat`` when none are given (the system prompt is the demo's handbook).
CHAT_MESSAGES = (
    "How many volunteer hours does a member owe each month?",
    "And what happens when a member misses them?",
    "Who may shop on Saturdays, and at what price?",
    "Summarize your answers in one sentence.",
)


def chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A chat through one prefix store; exit status 1 when an answer differs from DynamicCache's."""
    from .ab.chat import chat_turns, format_turn
    from .prefix import PrefixStore

    _check_model(args.model, parser)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    system = _system_text(args, parser)
    _check_folder(args.store, "--store", parser)
    _threads(args.threads)
    if args.interactive and args.message:
        parser.error("--message and --interactive: give the messages one way (--interactive reads them from stdin)")
    model, tok = _load(args.model, parser, quiet=True)
    _check_chat_template(tok, args.model, parser)
    out = _text_out(args)
    store = PrefixStore(model.config, budget_bytes=args.budget_mib << 20)
    if args.store is not None and (Path(args.store) / "prefix_store.json").is_file():
        t = time.perf_counter()
        tokens = store.load(args.store, model=model)
        print(f"store {args.store}: {tokens:,} tokens mapped in {(time.perf_counter() - t) * 1e3:.1f} ms", file=out,
              flush=True)
    if args.interactive:
        messages = (line.strip() for line in sys.stdin if line.strip())
    else:
        messages = args.message or list(CHAT_MESSAGES)
    turns = []
    for turn in chat_turns(model, tok, messages, store=store, system=system, max_new_tokens=args.max_new_tokens,
                           compare=not args.no_compare):
        print(format_turn(turn), file=out, flush=True)
        turns.append(dataclasses.asdict(turn))
    stats = store.stats()
    print(f"store: {stats.entries} entries, {stats.bytes_held / 2**20:.1f} MiB held, {stats.hits} hits, "
          f"{stats.tokens_reused:,} tokens reused; prompt tokens computed {stats.prompt_tokens_computed:,} of "
          f"{stats.prompt_tokens:,}", file=out)
    if args.store is not None:
        store.save(args.store, model=model)
        print(f"store saved to {args.store}", file=out)
    if args.json is not None:
        _write_json(args.json, {"schema": "hf_vkv.chat/1", "turns": turns, "store": dataclasses.asdict(stats)})
    return 0 if all(t["same_tokens"] is not False for t in turns) else 1


def prefix_save(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hf-vkv prefix save DIR``: a system prompt computed once and saved as a mapped prefix store."""
    from .cli_prefix import save_system_prompt

    _check_model(args.model, parser)
    system = _system_text(args, parser)
    _check_folder(args.folder, "prefix save", parser)
    _threads(args.threads)
    model, tok = _load(args.model, parser, quiet=True)
    _check_chat_template(tok, args.model, parser)
    done = save_system_prompt(model, tok, system, args.folder)
    print(f"{args.folder}: {done['tokens']:,} system-prompt tokens computed in {done['compute_s']:.2f} s, saved in "
          f"{done['save_s']:.2f} s ({done['bytes_held'] / 2**20:.1f} MiB of pages); `hf-vkv chat --store "
          f"{args.folder}` starts from it")
    return 0


def prefix_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hf-vkv prefix inspect DIR [--verify]``: what a saved folder holds; exit 1 if its page file is not
    whole (header and size; with ``--verify`` every page's checksum)."""
    from .cli_prefix import summary, verify_folder
    from .prefix.errors import PrefixFileCorruptError

    folder = Path(args.folder)
    if not (folder / "prefix_store.json").is_file():
        parser.error(f"{folder} holds no prefix_store.json: not a folder PrefixStore.save wrote")
    info = summary(folder)
    weights = str(info["weights_fingerprint"])[:12] if info["weights_fingerprint"] else "not recorded"
    out = _text_out(args)
    print(f"{folder}: index version {info['version']} ({info['writer']}), model {info['model_type']} "
          f"(config {str(info['config_fingerprint'])[:12]}), {info['dtype']}, weights {weights}", file=out)
    print(f"mapped: {len(info['mapped_entries'])} entries of {info['mapped_entries']} tokens, {info['pages']} pages of "
          f"{info['page_bytes']} bytes ({info['file_bytes'] / 2**20:.1f} MiB file), layout {sorted(set(info['layout']))}; "
          f"prefix files: {len(info['prefix_files'])}", file=out)
    rc = 0
    try:  # the page file's header and size always (no page read); with --verify every page's checksum
        checked = verify_folder(folder, pages=args.verify)
        if args.verify:
            info["verified_pages"], info["verify_s"] = checked
            print(f"verified: {info['verified_pages']} pages, every checksum equal ({info['verify_s'] * 1e3:.1f} ms)",
                  file=out)
    except PrefixFileCorruptError as e:
        info["verify_error"] = str(e)
        print(f"NOT WHOLE: {e}", file=out)
        rc = 1
    if args.json is not None:
        _write_json(args.json, {"schema": "hf_vkv.prefix-inspect/1", **info})
    return rc


#: How ``hf-vkv ab --reuse`` names each ``--reference`` on a turn's line.
_REFERENCE_WORDS = {"continued": "continued from the previous turn", "prefill": "prefilling the whole prompt"}


def _ab_reuse(args: argparse.Namespace, parser: argparse.ArgumentParser, model: Any, tok: Any, texts: list[str],
              kwargs: dict[str, Any]) -> int:
    """``hf-vkv ab --reuse N``: an N-turn chat, each turn an A/B run whose vkv side reuses one
    prefix store. ``--reference continued`` (default): the DynamicCache side continues one
    DynamicCache from turn to turn (the history the store lent, continued over the new tokens),
    and every turn must be identical; ``--reference prefill``: DynamicCache prefills every turn
    whole, tokens compared, max |Δlogit| reported."""
    from transformers.cache_utils import DynamicCache

    from .ab import format_report, run_ab
    from .prefix import PrefixStore

    if len(texts) != 1:
        parser.error("--reuse runs a chat on one prompt: give one --prompt")
    store = PrefixStore(model.config)
    reference = args.reference or "continued"
    continued = reference == "continued"
    history_cache = DynamicCache(config=model.config) if continued else None  # the reference's conversation
    history = [{"role": "user", "content": texts[0]}]
    reports = []
    for turn in range(args.reuse):
        if args.raw or not getattr(tok, "chat_template", None):
            inputs = dict(tok([history[0]["content"]], return_tensors="pt"))
        else:
            inputs = dict(tok([tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)],
                              return_tensors="pt"))
        report = run_ab(model, inputs, max_new_tokens=args.max_new_tokens, layout=args.layout,
                        tee=continued and not args.no_tee, seed=args.seed, progress=not args.quiet,
                        pad_token_id=_pad_id(tok), prefix_store=store, reference=reference,
                        reference_cache=history_cache, **kwargs)
        reports.append(report)
        reused = report.prefix_reuse or {}
        print(f"turn {turn + 1}: {report.prompt_tokens} prompt tokens, {reused.get('reused_tokens', 0)} reused, "
              f"{reused.get('computed_tokens', 0)} computed; tokens identical: {report.tokens_identical}; "
              f"max |Δlogit| {report.max_abs_logit_diff:.3g} (against DynamicCache {_REFERENCE_WORDS[reference]})",
              file=_text_out(args))
        answer = tok.decode(list(report.generated_vkv[0]), skip_special_tokens=True).strip()
        if args.raw or not getattr(tok, "chat_template", None):
            history = [{"role": "user", "content": f"{history[0]['content']} {answer} Please go on."}]
        else:
            history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Please go on."}]
    print(format_report(reports[-1]), file=_text_out(args))
    if args.json is not None:
        _write_json(args.json, {"schema": "hf_vkv.ab-reuse/1", "turns": [r.to_dict() for r in reports]})
    return exit_code(reports)


# ---------------------------------------------------------------------------------------- bench
def bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The benchmark (:mod:`hf_vkv.ab.bench`, shared with ``benchmarks/generate_cpu.py``): tables on
    stdout, JSON to ``--json``."""
    from .ab.bench_args import grid_from_args, run_from_args, run_shared_from_args, shared_grid_from_args

    # --shared-prompt: the shared-prompt grid (hf_vkv.ab.shared_prompt) instead
    make_grid, run = (shared_grid_from_args, run_shared_from_args) if args.shared_prompt else (grid_from_args,
                                                                                               run_from_args)
    try:
        grid = make_grid(args)
    except ValueError as e:
        parser.error(str(e))
    _check_model(args.model, parser)
    _threads(args.threads)
    model, _ = _load(args.model, parser)
    name = DEFAULT_MODEL_NAME if args.model == DEFAULT_MODEL else args.model
    return run(args, model, grid=grid, model_name=name, command=" ".join(["hf-vkv", *sys.argv[1:]]),
               json_path=Path(args.json))


# --------------------------------------------------------------------------------------- doctor
def doctor(args: argparse.Namespace) -> int:
    """What this machine gives the cache: one line per check (or JSON); 1 when a check failed."""
    from .doctor import doctor_exit_code, doctor_to_dict, format_checks, run_checks

    checks = run_checks()
    if args.json:
        _write_json("-", doctor_to_dict(checks))
    else:
        print(format_checks(checks))
    return doctor_exit_code(checks)


# ---------------------------------------------------------------------------------------- serve
SERVE_EPILOG = """Every other argument is transformers serve's own (`transformers serve --help`), passed as it is:
the model to preload ('default': the embedded SmolLM2), --host, --port, --continuous-batching, ...
Each model the server loads generates with cache_implementation="vkv" and one prefix store, so a
conversation prefills only what no earlier request computed (docs/serve.md)."""


def _serve_model_at(rest: Sequence[str]) -> int | None:
    """Where the model (the positional argument) is among ``transformers serve``'s arguments, which
    may come before it (``--port 8000 default``): options that take no value are read from its
    command's flags (click's, through typer), any other option takes the next argument."""
    import click
    import typer
    from transformers.cli.transformers import app

    command = app if isinstance(app, click.Command) else typer.main.get_command(app)
    serve_command = command.commands.get("serve") if isinstance(command, click.Group) else None
    flags = {name for param in getattr(serve_command, "params", []) if isinstance(param, click.Option) and param.is_flag
             for name in (*param.opts, *param.secondary_opts)}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":  # the end of options: the model follows
            return i + 1 if i + 1 < len(rest) else None
        if not arg.startswith("-"):
            return i
        i += 1 if "=" in arg or arg in flags else 2
    return None


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hf-vkv serve``: transformers' own server, each model generating with vkv and its prefix store."""
    from .generate.registry import register_serving

    os.environ[serving.STORE_BYTES_ENV] = str(args.prefix_store_mib << 20)
    if args.prefix_dir is not None:
        folder = Path(args.prefix_dir).resolve()
        if not folder.is_dir():
            parser.error(f"--prefix-dir {args.prefix_dir}: no such folder (save one first: hf-vkv prefix save "
                         f"{args.prefix_dir} --system-file FILE)")
        if not (folder / "prefix_store.json").is_file():
            parser.error(f"--prefix-dir {args.prefix_dir}: no prefix_store.json there (a folder `hf-vkv prefix save` "
                         "or PrefixStore.save wrote)")
        from .cli_prefix import summary, verify_folder

        try:
            held = int(summary(folder)["file_bytes"])
            verify_folder(folder, pages=True)  # the page file there, of its size, every page against its checksum
        except (OSError, ValueError) as exc:  # a damaged index (not JSON, its digest differs), a truncated page file
            parser.error(f"--prefix-dir {args.prefix_dir}: {type(exc).__name__}: {exc}")
        if held > args.prefix_store_mib << 20:
            parser.error(f"--prefix-dir {args.prefix_dir} holds {held / 2**20:,.0f} MiB of pages, more than "
                         f"--prefix-store-mib {args.prefix_store_mib}: raise it")
        os.environ[serving.PREFIX_DIR_ENV] = str(folder)
    rest = list(args.serve_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    at = _serve_model_at(rest)
    if at is not None and rest[at] == DEFAULT_MODEL:
        from .default_model import default_model_dir, load_default_model

        load_default_model()  # converts the embedded GGUF to a model folder on first use
        rest[at] = str(default_model_dir())
    try:
        register_serving()
    except ImportError as exc:
        parser.error(str(exc))
    from transformers.cli.transformers import app

    try:
        app(["serve", *rest], prog_name="hf-vkv serve")
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


# ----------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    from .ab.bench_args import add_arguments, add_shared_prompt_arguments, int_at_least

    count = int_at_least(1)  # counts: an explicit 0 or negative is a usage error, not the default
    parser = argparse.ArgumentParser(prog="hf-vkv", description="A virtual-memory KV cache for transformers. "
                                     "Exit status: 0 identical to DynamicCache, 1 diverged (doctor: a check "
                                     "failed), 2 usage error, 3 vkv refused the run (one line says why).")
    parser.add_argument("--version", action="version", version=f"hf_vkv {__version__}",
                        help="print the version (hf_vkv X.Y.Z) and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="where vkv wins: a ~1k-token document answered with n=8 sampling and 4 beams, "
                       "and a short greedy prompt, each A/B-checked against DynamicCache on the embedded SmolLM2")
    p.add_argument("--max-new-tokens", type=int, default=DEMO_NEW_TOKENS, help="per row (default: %(default)s)")
    p.add_argument("--document-tokens", type=int, default=None, metavar="N",
                   help="cut the shared document to its first N tokens (default: all of it, ~1k)")
    p.add_argument("--threads", type=count, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress, no generated text: the tables only")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON (hf_vkv.demo/1); "
                   "'-': JSON on stdout instead of the tables")
    p.set_defaults(func=demo, command_parser=p)

    p = sub.add_parser("doctor", help="what this machine gives the cache: backend, page size and layout, map limit, "
                       "CUDA, Triton, versions; each OK or a fix (exit 1 when vkv cannot run here)",
                       epilog=f"{SIMULATE_HELP}")
    p.add_argument("--json", action="store_true", help="the checks as JSON (hf_vkv.doctor/1) on stdout")
    p.set_defaults(func=lambda args, _: doctor(args), command_parser=p)

    p = sub.add_parser("ab", help="one A/B run against DynamicCache, step by step (table, JSON, plot)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'default' (the embedded SmolLM2) or a local model folder "
                   "with its tokenizer (default: %(default)s)")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: the demo's)")
    prompts.add_argument("--prompts-file", help="a text file with one prompt per line (a left-padded batch)")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the tokenizer's chat template")
    p.add_argument("--mode", choices=sorted(_MODE_KWARGS), default="greedy",
                   help="greedy search, seeded sampling or beam search (default: %(default)s)")
    p.add_argument("--num-beams", type=count, default=None, help="beams of --mode beam (default 4)")
    p.add_argument("--num-return-sequences", type=int, default=1,
                   help="sequences returned per prompt (sampling: continuations sharing the prompt's pages; "
                        "default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per row (default: %(default)s)")
    p.add_argument("--layout", choices=get_args(AttentionPath), default="contiguous",
                   help="the vkv run's attention path (not the cache layout): contiguous, the model's attention "
                        "reads what update returns; paged, the 'vkv_paged' attention reads the pages; cascade, the "
                        "'vkv_cascade' attention reads a prefix shared by several rows once (reorders float sums: "
                        "passes with identical tokens and float32 logits within 1e-4; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="torch seed before each of the two runs (default: %(default)s)")
    p.add_argument("--no-tee", action="store_true", help="compare tokens and logits only, not every layer's K/V")
    p.add_argument("--reuse", type=int_at_least(0), default=0, metavar="TURNS",
                   help="a chat of TURNS turns whose vkv runs reuse a prefix store, each compared with a DynamicCache "
                        "that holds the same history, continued over the new tokens (see --reference)")
    p.add_argument("--reference", choices=["continued", "prefill"], default=None,
                   help="with --reuse, the DynamicCache side of each turn: continued, the previous turn's "
                        "DynamicCache continued (exact: tokens, logits and K/V identical; the default); prefill, the "
                        "whole conversation prefilled again (a different float sum: tokens compared, max |Δlogit| "
                        "reported; implies --no-tee)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON (hf_vkv.ab/1); "
                   "'-': JSON on stdout instead of the table")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="plot KV memory and step time")
    p.add_argument("--threads", type=count, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=ab, command_parser=p)

    p = sub.add_parser("chat", help="a chat through a prefix store on the embedded model: each turn's reused tokens "
                                    "and time to first token beside DynamicCache's re-prefill")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'default' or a local model folder (default: %(default)s)")
    p.add_argument("--message", action="append", help="a user message (repeat for turns; default: four questions "
                                                      "about the demo's handbook)")
    p.add_argument("--interactive", action="store_true", help="read user messages from stdin, one per line")
    p.add_argument("--system-file", default=None, help="the system prompt (default: the demo's ~1k-token handbook)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per turn (default: %(default)s)")
    p.add_argument("--budget-mib", type=count, default=1024, help="the store's budget (default: %(default)s MiB)")
    p.add_argument("--no-compare", action="store_true", help="no DynamicCache re-prefill beside each turn")
    p.add_argument("--threads", type=count, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the turns as JSON (hf_vkv.chat/1)")
    p.add_argument("--store", default=None, metavar="DIR", help="start from the prefix store saved in DIR (its pages "
                   "mapped, not read: `hf-vkv prefix save DIR`), and save the store there after the chat")
    p.set_defaults(func=chat, command_parser=p)

    p = sub.add_parser("prefix", help="save a system prompt's KV to a folder later processes map; inspect a saved folder")
    verbs = p.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("save", help="compute a system prompt once and save it as a mapped prefix store")
    s.add_argument("folder", help="where to save (prefix_store.kv and prefix_store.json)")
    s.add_argument("--model", default=DEFAULT_MODEL, help="'default' or a local model folder (default: %(default)s)")
    s.add_argument("--system-file", default=None, help="the system prompt (default: the demo's ~1k-token handbook)")
    s.add_argument("--threads", type=count, default=None, help="torch threads (default: torch's)")
    s.set_defaults(func=prefix_save, command_parser=s)
    s = verbs.add_parser("inspect", help="what a saved folder holds; --verify checks every page")
    s.add_argument("folder")
    s.add_argument("--verify", action="store_true", help="read the page file and check every page's checksum")
    s.add_argument("--json", default=None, metavar="OUT", help="also write the summary as JSON")
    s.set_defaults(func=prefix_inspect, command_parser=s)

    p = sub.add_parser("serve", help="transformers' own OpenAI-compatible server (`transformers serve`), every model "
                       "generating with vkv and one prefix store: a chat turn prefills only its new tokens",
                       usage="hf-vkv serve [-h] [--prefix-store-mib MIB] [--prefix-dir DIR] [transformers serve's "
                             "arguments ...]",
                       epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)  # an abbreviation of vkv's options could be one of transformers' options
    p.add_argument("--prefix-store-mib", type=count, default=serving.DEFAULT_STORE_BYTES >> 20,
                   help="each model's prefix store budget, least recently used evicted first (default: %(default)s)")
    p.add_argument("--prefix-dir", default=None, metavar="DIR",
                   help="start each model's store from this saved folder (`hf-vkv prefix save`), its pages mapped: a "
                        "saved system prompt is not prefilled, and servers on one machine share its pages")
    p.set_defaults(func=serve, command_parser=p, serve_args=[])  # the rest of the line: see main

    p = sub.add_parser("bench", help="decode-step benchmark grid: DynamicCache, an ideal cache and each vkv layout "
                       "(and optionally generate() A/B runs), as a table and JSON")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'default' or a local model folder (default: %(default)s)")
    p.add_argument("--json", default="hf-vkv-bench.json", metavar="OUT", help="default: %(default)s")
    add_arguments(p, default="quick")
    add_shared_prompt_arguments(p, standalone=False)
    p.set_defaults(func=bench, command_parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-vkv`` console script."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.serve_args = rest  # hf-vkv serve: every argument not vkv's goes to transformers serve, in its order
    _check_outputs(args, args.command_parser)
    try:
        return int(args.func(args, args.command_parser))
    except InvariantError:
        raise  # a bug in hf_vkv, not a refusal: the traceback is wanted
    except VKVError as exc:
        from transformers.utils import logging as hf_logging

        from .devices import UnsupportedDeviceError
        from .memory import BackendError, MappingLimitError, PageSizeError

        machine = isinstance(exc, (BackendError, UnsupportedDeviceError, MappingLimitError, PageSizeError))
        hf_logging.get_logger("hf_vkv").error(
            f"hf-vkv {args.command}: vkv refused to run: {type(exc).__name__}: {' '.join(str(exc).split())}"
            + (" (see `hf-vkv doctor`)" if machine else ""))
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())

"""Prefix reuse inside generate() on the embedded SmolLM2-135M (fp32, CPU): a chat and a document.

``chat``: a multi-turn chat with a long system prompt. Each turn runs
  * ``vkv_reuse``: ``generate(cache_implementation="vkv", cache_config={"prefix_store": store})``;
  * ``vkv_reuse_64k``: the same through a second store whose pages are 64 KiB (fewer pages to map
    when a row starts from an entry; up to 4x more memory stranded per row);
  * ``dynamic_full``: DynamicCache on the whole history (what transformers does by default);
  * the bound: prefilling only the turn's new tokens. Computing them exactly means attending to
    the history, so the bound is a cache that already holds it and computes nothing else:
    ``ideal_continued``, the benchmarks' ideal cache (``IdealCache``: K/V preallocated, narrow
    views, no copy) loaded with the previous turn's K/V (not counted in its TTFT), and
    ``dynamic_continued``, transformers' documented workaround, a DynamicCache of the previous
    turn deep-copied (``deepcopy_s``, not counted) and continued;
  * ``no_history``: DynamicCache on the new tokens with no history at all: not the turn's
    computation (the tokens attend to nothing before them), shown for the history's share.
  Every column is timed ``--repeats`` times per turn (vkv through as many stores playing the same
  chat) and reported by its median; the ratios are of medians. Reports per turn the time to first
  token (TTFT, a streamer's first token), vkv's seconds before
  the model's prefill (lookup and ``take_rows``), Python's garbage-collector pauses inside each
  timed call (``gc.callbacks``: a full collection of this process's ~420k objects takes ~0.23 s
  and lands in whichever call crosses the threshold; each timed call starts after a full
  collection, outside its time, so a pause inside it is the call's own garbage), the prompt tokens
  computed (the store's counters), the new tokens (not in the previous call's sequence), and
  whether the tokens equal DynamicCache's.

``document``: ``--batch`` different questions about one long document in one batch: vkv with an
  empty store (the document is prefilled once, then each row only its question) against DynamicCache.

Usage: ``python benchmarks/prefix_reuse.py chat --turns 20 --system-tokens 2048 --threads 1``.

More subcommands, each with its own ``--help``:

* ``exactness``: prefix reuse's max |Δlogit| against DynamicCache through ``run_ab`` (float32 and
  bfloat16, 1 and 2 threads; ``results/prefix_reuse_exactness.json``);
* ``history``: one forward of a turn's new tokens over a stored history, sdpa with and without
  the ``repeat_kv`` copy, against no history (``results/history_attention.json``);
* ``profile``: a chat turn under ``torch.profiler``, vkv with a store against DynamicCache
  continued and the new tokens alone (``results/profile_prefix_turn_{1,2}t.json``);
* ``lookup``: time to first token through ``store.lookup`` by hand, against a full prefill
  (``results/prefix_ttft.json``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import hf_vkv
from hf_vkv import PrefixStore
from hf_vkv.ab import run_ab
from hf_vkv.ab.demo_text import DOCUMENT
from hf_vkv.ab.harness import describe_environment
from hf_vkv.ab.ideal import IdealCache
from hf_vkv.default_model import load_default_model
from hf_vkv import reuse_report
from hf_vkv.generate import cache_kwarg
from common import StepClock, dispatch, write_report


RESULTS = Path(__file__).resolve().parent / "results"
QUESTIONS = [
    "How many volunteer hours does a member owe each month?",
    "Who may shop on Saturdays?",
    "What is the fixed margin on groceries?",
    "Where did the store open?",
    "How many member households are there?",
    "What pays for the delivery van?",
    "Who decides what happens to the surplus?",
    "What does a household buy to join?",
]
USER_TURNS = [
    "Summarize the first section in one sentence.", "What is the margin used for?", "Is there a van?",
    "Can anyone join?", "What about non-members?", "Give me one number from the text.", "Who are the managers?",
    "What happens at the annual meeting?", "Where is Quay Street?", "Say it shorter.", "And the building fund?",
    "Thank you. One more question: what is a share?", "Is the store open on Sundays?", "List two rules.",
    "How do I leave the cooperative?", "Translate 'cooperative' to French.", "What is a chandlery?",
    "Repeat your last answer.", "Is the margin high?", "Goodbye.",
]


def long_text(tokenizer: Any, tokens: int) -> str:
    """The demo handbook repeated (numbered) until it holds at least ``tokens`` tokens."""
    parts, n, k = [], 0, 1
    while n < tokens:
        parts.append(f"Part {k}.\n{DOCUMENT}")
        n = len(tokenizer("\n".join(parts))["input_ids"])
        k += 1
    ids = tokenizer("\n".join(parts))["input_ids"][:tokens]
    return tokenizer.decode(ids)


class GcPauses:
    """Python's garbage collections' pauses (``gc.callbacks``): ``seconds`` sums them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


GC = GcPauses()


def ttft(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> tuple[float, torch.Tensor]:
    """Seconds to the first token of one generate() call, and its output. A full garbage
    collection runs first, outside the time, so that no call pays for the garbage of the calls
    before it (a full collection of this process takes ~0.2 s)."""
    gc.collect()
    return _first_token(model, ids, mask, **kwargs)


def _first_token(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> tuple[float, torch.Tensor]:
    clock = StepClock()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, streamer=clock, do_sample=False, **kwargs)
    return clock.times[1] - start, out


def ttft_gc(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> tuple[float, float, torch.Tensor]:
    """:func:`ttft` and the seconds Python's garbage collector paused the process meanwhile (up to
    the end of the call: a pause after the first token is included, an upper bound)."""
    gc.collect()
    before = GC.seconds
    t, out = _first_token(model, ids, mask, **kwargs)
    return t, GC.seconds - before, out


def chat(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    budget = args.budget_mib << 20
    # ``--repeats`` stores of each page size play the same chat (a turn's call is timed once per
    # store: a second call through one store would find the turn's answer stored); 64 KiB pages:
    # fewer pages to map per row, more stranded
    stores = {"vkv_reuse": [PrefixStore(model.config, budget_bytes=budget) for _ in range(args.repeats)],
              "vkv_reuse_64k": [PrefixStore(model.config, budget_bytes=budget, cache_config={"page_bytes": 65536})
                                for _ in range(args.repeats)]}
    store = stores["vkv_reuse"][0]
    messages = [{"role": "system", "content": long_text(tok, args.system_tokens)}]
    previous: list[int] = []  # the last call's sequence (prompt + answer)
    previous_cache = None  # DynamicCache of the last call (its sequence but the last token)
    turns = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids, mask = ids["input_ids"], ids["attention_mask"]
        prompt = ids[0].tolist()
        shared = 0
        while shared < min(len(prompt), len(previous)) and prompt[shared] == previous[shared]:
            shared += 1
        new = len(prompt) - shared
        before = store.stats()
        samples: dict[str, list[tuple[float, float, float]]] = {}  # column -> (ttft, gc pause, start) per repeat
        outputs: list[torch.Tensor] = []
        for k in range(args.repeats):  # the columns interleaved
            for column, kind in stores.items():
                t, pause, out = ttft_gc(model, ids, mask, max_new_tokens=args.new_tokens, return_dict_in_generate=True,
                                        cache_implementation="vkv", cache_config={"prefix_store": kind[k]})
                report, out = reuse_report(out), out.sequences
                samples.setdefault(column, []).append((t, pause, report.seconds_to_start))
                outputs.append(out)
                if k == 0 and column == "vkv_reuse":
                    first_report = report
        report, out = first_report, outputs[0]
        after = store.stats()
        new_ids = ids[:, shared:] if new else ids[:, -1:]
        samples["no_history"] = [(ttft(model, new_ids, torch.ones_like(new_ids), max_new_tokens=1)[0], 0.0, 0.0)
                                 for _ in range(args.repeats)]
        first_equal: dict[str, bool] = {}
        deepcopy_s: list[float] = []
        if previous_cache is not None:
            keep = min(shared, previous_cache.get_seq_length(), len(prompt) - 1)
            for _ in range(args.repeats):
                ideal = IdealCache(model.config, capacity=len(prompt) + 1)
                for layer, held in enumerate(previous_cache.layers):
                    ideal.update(held.keys[:, :, :keep], held.values[:, :, :keep], layer)
                t, pause, first = ttft_gc(model, ids, mask, max_new_tokens=1, **{cache_kwarg(): ideal})
                samples.setdefault("ideal_continued", []).append((t, pause, 0.0))
                first_equal["ideal_continued"] = bool(torch.equal(first, out[:, :first.shape[1]]))
                del ideal
                start = time.perf_counter()
                continued = copy.deepcopy(previous_cache)
                deepcopy_s.append(time.perf_counter() - start)
                if keep < continued.get_seq_length():
                    continued.crop(keep - continued.get_seq_length())  # a negative count: tokens to remove
                t, pause, first = ttft_gc(model, ids, mask, max_new_tokens=1, **{cache_kwarg(): continued})
                samples.setdefault("dynamic_continued", []).append((t, pause, 0.0))
                first_equal["dynamic_continued"] = bool(torch.equal(first, out[:, :first.shape[1]]))
                del continued
        row: dict[str, Any] = {
            "turn": turn + 1, "prompt_tokens": len(prompt), "new_tokens": new, "no_history_tokens": new_ids.shape[1],
            "computed_tokens": after.prompt_tokens_computed - before.prompt_tokens_computed,
            "reused_tokens": report.reused_tokens,
            "ttft_s": {c: statistics.median(x[0] for x in v) for c, v in samples.items()},
            "ttft_s_repeats": {c: [x[0] for x in v] for c, v in samples.items()},
            "vkv_start_s": {c: statistics.median(x[2] for x in samples[c]) for c in stores},
            "gc_pause_s": {c: max(x[1] for x in v) for c, v in samples.items() if c != "no_history"},
            "store_bytes_held": after.bytes_held,
            "store_64k_bytes_held": stores["vkv_reuse_64k"][0].stats().bytes_held,
            "tokens_equal_across_stores": all(torch.equal(o, out) for o in outputs),
            "first_token_equal": first_equal,
        }
        if deepcopy_s:
            row["deepcopy_s"] = statistics.median(deepcopy_s)
        if not args.skip_dynamic:
            t_dyn, full = ttft(model, ids, mask, max_new_tokens=args.new_tokens, return_dict_in_generate=True)
            want, previous_cache = full.sequences, getattr(full, cache_kwarg())
            row["ttft_s"]["dynamic_full"] = t_dyn
            row["tokens_equal_dynamic"] = bool(torch.equal(want, out))
        t_reuse, t_64k = row["ttft_s"]["vkv_reuse"], row["ttft_s"]["vkv_reuse_64k"]
        for column in ("ideal_continued", "dynamic_continued", "no_history"):
            if column in row["ttft_s"]:
                for mine, t in (("ttft", t_reuse), ("ttft_64k", t_64k)):
                    row[f"{mine}_vs_{column}"] = t / row["ttft_s"][column]
        if "ideal_continued" in row["ttft_s"]:
            row["dynamic_continued_vs_ideal_continued"] = (row["ttft_s"]["dynamic_continued"]
                                                           / row["ttft_s"]["ideal_continued"])
            row["ideal_continued_vs_no_history"] = row["ttft_s"]["ideal_continued"] / row["ttft_s"]["no_history"]
        turns.append(row)
        print(row, flush=True)
        answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        previous = out[0].tolist()
        for kind in stores.values():
            for s in kind:
                s.check_invariants()
                assert s.stats().bytes_held <= s.budget_bytes
    total_new = sum(t["new_tokens"] for t in turns)
    total_computed = sum(t["computed_tokens"] for t in turns)
    ratios = ("ttft_vs_ideal_continued", "ttft_vs_dynamic_continued", "ttft_vs_no_history",
              "ttft_64k_vs_ideal_continued", "ttft_64k_vs_dynamic_continued", "ttft_64k_vs_no_history",
              "dynamic_continued_vs_ideal_continued", "ideal_continued_vs_no_history")

    def over_turns(key: str, part: str | None = None, reduce: Any = statistics.median) -> float | None:
        values = [(t[part] if part else t).get(key) for t in turns[1:]]
        values = [v for v in values if v is not None]
        return reduce(values) if values else None

    columns = ("vkv_reuse", "vkv_reuse_64k", "ideal_continued", "dynamic_continued", "no_history", "dynamic_full")
    return {
        "target": ("each turn's TTFT <= 1.2x prefilling only its new tokens over the history as transformers does "
                   "it (ttft_vs_dynamic_continued); ttft_vs_ideal_continued: against the limit"),
        "medians_turns_2_on": {
            "ttft_s": {c: over_turns(c, "ttft_s") for c in columns},
            "vkv_start_s": {c: over_turns(c, "vkv_start_s") for c in ("vkv_reuse", "vkv_reuse_64k")},
            **{key: over_turns(key) for key in ratios},
        },
        "max_turns_2_on": {key: over_turns(key, reduce=max) for key in ratios},
        "turns_with_gc_pause_over_50ms": {c: [t["turn"] for t in turns if t["gc_pause_s"].get(c, 0) > 0.05]
                                         for c in ("vkv_reuse", "vkv_reuse_64k", "ideal_continued",
                                                   "dynamic_continued")},
        "all_tokens_equal_across_stores": all(t["tokens_equal_across_stores"] for t in turns),
        "continued_first_tokens_equal_vkv": all(all(t.get("first_token_equal", {}).values()) for t in turns),
        "system_tokens": args.system_tokens, "turns": turns, "total_new_tokens": total_new,
        "total_computed_tokens": total_computed, "computed_over_new": total_computed / total_new,
        "total_prompt_tokens_dynamic": sum(t["prompt_tokens"] for t in turns),
        "all_tokens_equal_dynamic": None if args.skip_dynamic else all(t["tokens_equal_dynamic"] for t in turns),
        "store": store.stats().__repr__(),
    }


def document(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    doc = long_text(tok, args.system_tokens)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{q}"}], add_generation_prompt=True,
                                     tokenize=False) for q in QUESTIONS[:args.batch]]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    rounds = []
    for _ in range(args.rounds):
        store = PrefixStore(model.config, budget_bytes=args.budget_mib << 20)  # empty: nothing stored before
        t_reuse, out = ttft(model, ids, mask, max_new_tokens=args.new_tokens, cache_implementation="vkv",
                            cache_config={"prefix_store": store}, return_dict_in_generate=True)
        report, out = reuse_report(out), out.sequences
        t_dyn, want = ttft(model, ids, mask, max_new_tokens=args.new_tokens)
        rounds.append({"ttft_s": {"vkv_reuse": t_reuse, "dynamic_full": t_dyn},
                       "tokens_equal_dynamic": bool(torch.equal(want, out)),
                       "common_prefix_tokens": report.common_prefix_tokens, "computed_tokens": report.computed_tokens,
                       "copied_rows": report.copied_rows, "seconds_to_start": report.seconds_to_start,
                       "prompt_tokens": int(mask.sum())})
        print(rounds[-1], flush=True)
        store.check_invariants()
    med = {k: statistics.median(r["ttft_s"][k] for r in rounds) for k in ("vkv_reuse", "dynamic_full")}
    return {"document_tokens": args.system_tokens, "batch": args.batch, "prompt_width": ids.shape[1], "rounds": rounds,
            "ttft_median_s": med, "ttft_ratio_reuse_over_dynamic": med["vkv_reuse"] / med["dynamic_full"]}


def default_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=("chat", "document"))
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="document: rounds")
    parser.add_argument("--repeats", type=int, default=5, help="chat: timed calls per column and turn (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--skip-dynamic", action="store_true", help="chat: no DynamicCache full re-prefill per turn")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    result = chat(model, tok, args) if args.workload == "chat" else document(model, tok, args)
    report = {
        "benchmark": f"prefix_reuse_{args.workload}", "model": "SmolLM2-135M-Instruct (embedded, float32)",
        "device": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "hf_vkv": getattr(hf_vkv, "__version__", "?")},
        "command": "python benchmarks/prefix_reuse.py " + " ".join(sys.argv[1:]), **result,
    }
    write_report(args.out or RESULTS / f"prefix_reuse_{args.workload}_{args.threads}t.json", report)


# ---------------------------------------- exactness (formerly benchmarks/prefix_reuse_exactness.py)
EXACTNESS_DOC = """How far prefix reuse's logits are from DynamicCache's full prefill (SmolLM2-135M, CPU).

For each dtype and thread count, ``run_ab(..., prefix_store=store)`` runs short chats (each turn
the whole conversation; vkv reuses the store, DynamicCache prefills it whole) and a
document-then-question case whose stored prefix is a prompt only (no decode-step K/V in it).
Writes, per case, whether the tokens were identical, whether the logits were bit-equal, and the
max |Δlogit|. Beam search's logits are compared beam by beam (rows of the same token history,
``StepReport.beams_unmatched`` counts the vkv beams the DynamicCache run did not hold at a step).

Usage: ``python benchmarks/prefix_reuse.py exactness [--turns 3] [--chats 3]``.
"""


OPENERS = ["What is a food cooperative?", "Write a haiku about the sea.", "Name three prime numbers.",
           "How do I boil an egg?", "Explain a key-value cache briefly."]
FOLLOW_UPS = ["Please go on.", "Say it in other words.", "Why?"]


def encode(tok: Any, history: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    return dict(tok([text], return_tensors="pt"))


def chats(model: Any, tok: Any, args: argparse.Namespace, mode: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for c in range(args.chats):
        store = PrefixStore(model.config)
        history = [{"role": "user", "content": OPENERS[c % len(OPENERS)]}]
        for turn in range(args.turns):
            report = run_ab(model, encode(tok, history), max_new_tokens=args.new_tokens, tee=False, prefix_store=store, reference="prefill",
                            pad_token_id=tok.eos_token_id, **mode)
            out.append({"chat": c, "turn": turn + 1, "prompt_tokens": report.prompt_tokens,
                        "reused_tokens": report.prefix_reuse["reused_tokens"],
                        "tokens_identical": report.tokens_identical,
                        "logits_bit_equal": report.first_divergence is None,
                        "max_abs_logit_diff": report.max_abs_logit_diff,
                        "beams_unmatched": (sum(s.beams_unmatched or 0 for s in report.steps)
                                            if report.mode == "beam" else None)})
            answer = tok.decode(list(report.generated_vkv[0]), skip_special_tokens=True).strip()
            history += [{"role": "assistant", "content": answer},
                        {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    return out


def prompt_only(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    """A stored prompt (prefilled, no answer): the document; then the document and a question."""
    store = PrefixStore(model.config)
    doc = dict(tok([DOCUMENT], return_tensors="pt"))
    model.generate(**doc, max_new_tokens=1, do_sample=False, cache_implementation="vkv",
                   cache_config={"prefix_store": store}, pad_token_id=tok.eos_token_id)  # stores the document's K/V
    asked = dict(tok([DOCUMENT + "\nQuestion: how many volunteer hours are owed each month?"], return_tensors="pt"))
    report = run_ab(model, asked, max_new_tokens=args.new_tokens, tee=False, prefix_store=store, reference="prefill", do_sample=False,
                    pad_token_id=tok.eos_token_id)
    return {"prompt_tokens": report.prompt_tokens, "reused_tokens": report.prefix_reuse["reused_tokens"],
            "tokens_identical": report.tokens_identical, "logits_bit_equal": report.first_divergence is None,
            "max_abs_logit_diff": report.max_abs_logit_diff,
            "prefill_logit_diff": report.steps[0].max_abs_logit_diff}


def main_exactness(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prefix_reuse.py exactness", description=EXACTNESS_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" /
                        "prefix_reuse_exactness.json")
    args = parser.parse_args(argv)
    results = []
    for dtype_name in args.dtypes.split(","):
        model, tok = load_default_model(dtype=getattr(torch, dtype_name))
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            cases = {"greedy": {"do_sample": False}, "beams": {"do_sample": False, "num_beams": 3},
                     "sample": {"do_sample": True, "top_k": 0}}
            row: dict[str, Any] = {"dtype": dtype_name, "threads": threads, "prompt_only": prompt_only(model, tok, args)}
            for name, mode in cases.items():
                turns = chats(model, tok, args, mode)
                row[name] = {"turns": turns, "all_tokens_identical": all(t["tokens_identical"] for t in turns),
                             "max_abs_logit_diff": max(t["max_abs_logit_diff"] for t in turns)}
                if name == "beams":  # (step, row) pairs whose beam the DynamicCache run did not hold
                    row[name]["beams_unmatched"] = sum(t["beams_unmatched"] for t in turns)
            print({k: (v if k in ("dtype", "threads", "prompt_only") else
                       {"ok": v["all_tokens_identical"], "max": v["max_abs_logit_diff"]}) for k, v in row.items()},
                  flush=True)
            results.append(row)
    write_report(args.out, {
        "benchmark": "prefix_reuse_exactness", "model": "SmolLM2-135M-Instruct (embedded)",
        "device": platform.processor() or platform.machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "hf_vkv": getattr(hf_vkv, "__version__", "?")},
        "command": "python benchmarks/prefix_reuse.py " + " ".join(sys.argv[1:]), "results": results,
    })


# ---------------------------------------- history (formerly benchmarks/history_attention.py)
HISTORY_DOC = """What prefilling a chat turn's new tokens over a stored history costs any exact cache.

A reused chat turn (``benchmarks/prefix_reuse.py chat``) prefills only its new tokens, but they
still attend to the whole history: that attention is work no cache removes. On the embedded
SmolLM2-135M (fp32), for each ``--history`` length and ``--new`` new tokens, one forward
(``logits_to_keep=1``) of the new tokens:

* ``new_alone``: over an empty DynamicCache (no history: not a reused turn's computation, the
  history's share);
* ``continued``: over a DynamicCache holding the history (deep-copied before each call, not
  timed): what a reused turn computes, with transformers' ``sdpa`` (on the CPU with a mask it
  repeats each key/value head for its query heads, a copy of the history per layer);
* ``continued_gqa``: the same with ``sdpa`` told to read grouped heads in place
  (``enable_gqa=True``, no copy): the fastest exact attention torch offers here. Its logits are
  compared with ``continued``'s (``max_abs_dlogit``).

Also the arithmetic: the attention's multiply-adds over the history against the linear layers'
(both counted as 2 flops per multiply-add). Caches interleaved in one process, median of
``--rounds``, at each of ``--threads``.

    python benchmarks/prefix_reuse.py history --history 2048 4096 --new 16 --threads 1 2 \\
        --json benchmarks/results/history_attention.json
"""


VARIANTS = ("new_alone", "continued", "continued_gqa")


def sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             **_: Any) -> tuple[torch.Tensor, None]:
    """``sdpa`` on ``[B, H, q, D]`` queries and ``[B, Hkv, k, D]`` keys/values read in place."""
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def forward(model: Any, ids: torch.Tensor, cache: DynamicCache) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return time.perf_counter() - start, logits


def flops(model: Any, history: int, new: int) -> dict[str, float]:
    """GFLOP of the new tokens' attention over the history and themselves, and of their linear
    layers (the output head for the last token only)."""
    config = model.config
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    attention = 2 * 2 * new * (history + new) * dim * heads * config.num_hidden_layers
    decoder = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    linear = 2 * new * decoder + 2 * config.vocab_size * config.hidden_size
    return {"attention_gflop": attention / 1e9, "linear_gflop": linear / 1e9}


def main_history(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prefix_reuse.py history", description=HISTORY_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    AttentionInterface.register("sdpa_gqa", sdpa_gqa)
    AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)
    model = load_default_model()[0]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for history in args.history:
        ids = torch.randint(100, 40000, (1, history + args.new), generator=generator)
        stored = DynamicCache(config=model.config)
        model.set_attn_implementation("sdpa")
        forward(model, ids[:, :history], stored)
        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            logits: dict[str, torch.Tensor] = {}
            for r in range(args.rounds + 1):  # the first round warms up, untimed
                for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]:
                    model.set_attn_implementation("sdpa_gqa" if name == "continued_gqa" else "sdpa")
                    cache = DynamicCache(config=model.config) if name == "new_alone" else copy.deepcopy(stored)
                    t, logits[name] = forward(model, ids[:, history:], cache)
                    if r:
                        times[name].append(t)
            median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            row = {"history": history, "new": args.new, "threads": threads,
                   "ms": median, "rounds_ms": {n: [round(t * 1e3, 2) for t in ts] for n, ts in times.items()},
                   "continued_vs_new_alone": median["continued"] / median["new_alone"],
                   "continued_gqa_vs_new_alone": median["continued_gqa"] / median["new_alone"],
                   "max_abs_dlogit_gqa": (logits["continued_gqa"] - logits["continued"]).abs().max().item(),
                   **flops(model, history, args.new)}
            rows.append(row)
            print(row, flush=True)
    model.set_attn_implementation("sdpa")
    if args.json:
        write_report(Path(args.json), {
            "benchmark": "history_attention", "rounds": args.rounds,
            "method": "one forward of the new tokens (logits_to_keep=1) per variant, interleaved and rotated by "
                      "round, the first round untimed; median over rounds",
            "rows": rows, "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


# ---------------------------------------- profile (formerly benchmarks/profile_prefix_turn.py)
PROFILE_DOC = """Where a chat turn's time to first token goes, with a prefix store and without (SmolLM2-135M fp32, CPU).

A chat with a long system prompt is played for ``--turns`` turns through a store (vkv) and
DynamicCache. Then, ``--rounds`` times, a new user message (a different one each round, so vkv
computes the new tokens every time) is sent three ways, each under ``torch.profiler``:

* ``vkv_reuse``: ``generate(cache_implementation="vkv", cache_config={"prefix_store": store})``;
* ``dynamic_continued``: DynamicCache continued from a deep copy (made outside the profile) of the
  last turn's cache: the same new tokens over the same history, no lookup, no pages;
* ``new_alone``: DynamicCache on the new tokens alone, no history (not the turn's computation:
  the history's share).

Per call: the wall time to the first token, vkv's seconds before the model's prefill (lookup and
``take_rows``), and the profiler's self CPU time per operator group: ``linear`` (``aten::mm``:
projections and MLP, the same in the three), ``attention`` (the sdpa kernel: the new tokens
against the history), ``copies`` (``aten::copy_``: transformers' ``repeat_kv`` expands the 3 KV
heads to 9 when a mask is present, i.e. whenever a history is; vkv's page copy-on-write),
``cat`` (DynamicCache's growth), ``other``. Garbage collection is frozen after the model loads
(``gc.freeze()``), so a collection's pause does not land in one of the calls.

Usage: ``python benchmarks/prefix_reuse.py profile --threads 2``.
"""


GROUPS = {"aten::mm": "linear", "aten::addmm": "linear",
          "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
          "aten::_scaled_dot_product_attention_math": "attention", "aten::bmm": "attention",
          "aten::copy_": "copies", "aten::cat": "cat"}


def profiled(call: Any) -> tuple[float, dict[str, float], Any]:
    """``(seconds to the first token, self CPU seconds per operator group, output)`` of ``call()``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds, out = call()
    groups: dict[str, float] = {"linear": 0.0, "attention": 0.0, "copies": 0.0, "cat": 0.0, "other": 0.0}
    for event in prof.key_averages():
        groups[GROUPS.get(event.key, "other")] += event.self_cpu_time_total / 1e6
    groups["total"] = sum(groups.values())
    return seconds, groups, out


def main_profile(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prefix_reuse.py profile", description=PROFILE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=3, help="turns played before the profiled ones")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    gc.collect()
    gc.freeze()
    store = PrefixStore(model.config, budget_bytes=1 << 30)
    messages = [{"role": "system", "content": long_text(tok, args.system_tokens)}]
    cache = None
    for turn in range(args.turns):  # the conversation so far: stored by vkv, a DynamicCache kept
        messages.append({"role": "user", "content": USER_TURNS[turn]})
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        model.generate(**enc, max_new_tokens=12, do_sample=False, cache_implementation="vkv",
                       cache_config={"prefix_store": store})
        full = model.generate(**enc, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
        cache = getattr(full, cache_kwarg())
        answer = tok.decode(full.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    rounds = []
    for r in range(args.rounds):
        ask = [*messages, {"role": "user", "content": USER_TURNS[(args.turns + r) % len(USER_TURNS)]}]
        enc = tok.apply_chat_template(ask, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        held = store.longest_prefix(ids[0].tolist())
        continued = copy.deepcopy(cache)
        if held < continued.get_seq_length():
            continued.crop(held - continued.get_seq_length())
        new_ids = ids[:, continued.get_seq_length():]
        row: dict[str, Any] = {"prompt_tokens": ids.shape[1], "history_tokens": continued.get_seq_length(),
                               "new_tokens": new_ids.shape[1]}
        calls = {
            "vkv_reuse": lambda: ttft(model, ids, mask, max_new_tokens=1, cache_implementation="vkv",
                                      cache_config={"prefix_store": store}, return_dict_in_generate=True),
            "dynamic_continued": lambda: ttft(model, ids, mask, max_new_tokens=1, **{cache_kwarg(): continued}),
            "new_alone": lambda: ttft(model, new_ids, torch.ones_like(new_ids), max_new_tokens=1),
        }
        outs = {}
        for name in (calls if r % 2 == 0 else reversed(list(calls))):
            seconds, groups, outs[name] = profiled(calls[name])
            row[name] = {"ttft_s": seconds, "self_cpu_s": groups}
            if name == "vkv_reuse":
                report, outs[name] = reuse_report(outs[name]), outs[name].sequences
                row[name].update(start_s=report.seconds_to_start, computed_tokens=report.computed_tokens)
        row["first_token_equal"] = bool(torch.equal(outs["vkv_reuse"][:, -1], outs["dynamic_continued"][:, -1]))
        rounds.append(row)
        print({k: (v if not isinstance(v, dict) else {"ttft_s": round(v["ttft_s"], 3),
                                                     **{g: round(x, 4) for g, x in v["self_cpu_s"].items()}})
               for k, v in row.items()}, flush=True)
    names = ("vkv_reuse", "dynamic_continued", "new_alone")
    median = {n: {"ttft_s": statistics.median(r[n]["ttft_s"] for r in rounds),
                  "self_cpu_s": {g: statistics.median(r[n]["self_cpu_s"][g] for r in rounds)
                                 for g in rounds[0][n]["self_cpu_s"]}} for n in names}
    median["vkv_reuse"]["start_s"] = statistics.median(r["vkv_reuse"]["start_s"] for r in rounds)
    write_report(args.out or RESULTS / f"profile_prefix_turn_{args.threads}t.json", {
        "benchmark": "profile_prefix_turn", "model": "SmolLM2-135M-Instruct (embedded, float32)",
        "environment": describe_environment(model, command="python benchmarks/prefix_reuse.py "
                                            + " ".join(sys.argv[1:])),
        "torch_threads": torch.get_num_threads(), "played_turns": args.turns, "rounds": rounds, "median": median,
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
    })


# ---------------------------------------- lookup (formerly benchmarks/prefix_ttft.py)
LOOKUP_DOC = """Time to first token with and without prefix reuse, on the embedded SmolLM2-135M (fp32, CPU).

A request is a shared prefix of ``P`` tokens (a system prompt, earlier turns) plus a new suffix of
``--suffix`` tokens. For each ``P`` it times ``generate(max_new_tokens=1)`` (the first token) for:

* ``dynamic_full``: DynamicCache, the whole prompt prefilled;
* ``vkv_full``: ``cache_implementation="vkv"``, the whole prompt prefilled;
* ``vkv_reuse``: ``store.lookup(ids)`` (a zero-copy fork of the stored prefix) and the suffix
  prefilled: the lookup is inside the timed region. The prefix was prefilled and inserted once
  before (timed separately as ``store_fill_s``).

Every request gets a different suffix. The first token of each reuse run is compared with the
full prefill's (``first_token_equal``). Writes JSON with the device, versions, threads and the
exact command.

    python benchmarks/prefix_reuse.py lookup                        # 1k and 4k prefixes (a few minutes)
    python benchmarks/prefix_reuse.py lookup --prefix 256 --repeats 1   # a quick check
"""


def first_token(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> tuple[float, int]:
    """Seconds to the first generated token of ``ids`` ([1, T]) and that token."""
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **kwargs)
    return time.perf_counter() - start, int(out[0, -1])


def run(model: torch.nn.Module, prefix_len: int, *, suffix: int, repeats: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(100, vocab, (1, prefix_len), generator=g)
    suffixes = [torch.randint(100, vocab, (1, suffix), generator=g) for _ in range(repeats)]
    queries = [torch.cat([prefix, s], dim=1) for s in suffixes]

    times: dict[str, list[float]] = {"dynamic_full": [], "vkv_full": [], "vkv_reuse": []}
    tokens: dict[str, list[int]] = {k: [] for k in times}
    for q in queries:
        t, tok = first_token(model, q)
        times["dynamic_full"].append(t)
        tokens["dynamic_full"].append(tok)
        t, tok = first_token(model, q, cache_implementation="vkv")
        times["vkv_full"].append(t)
        tokens["vkv_full"].append(tok)

    store = hf_vkv.PrefixStore(model.config)
    start = time.perf_counter()
    cache = hf_vkv.VKVCache(model.config)
    with torch.inference_mode():
        model(prefix, past_key_values=cache)
    store.insert(prefix[0], cache)
    cache.close()
    fill = time.perf_counter() - start
    for q in queries:
        start = time.perf_counter()
        fork = store.lookup(q)
        reused = fork.get_seq_length()
        out = model.generate(q, attention_mask=torch.ones_like(q), past_key_values=fork, max_new_tokens=1,
                             do_sample=False)
        times["vkv_reuse"].append(time.perf_counter() - start)
        tokens["vkv_reuse"].append(int(out[0, -1]))
        assert reused == prefix_len, (reused, prefix_len)
        fork.close()
    stats = store.stats()
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "prefix_tokens": prefix_len,
        "suffix_tokens": suffix,
        "repeats": repeats,
        "ttft_s": times,
        "ttft_median_s": median,
        "speedup_reuse_vs_dynamic_full": median["dynamic_full"] / median["vkv_reuse"],
        "speedup_reuse_vs_vkv_full": median["vkv_full"] / median["vkv_reuse"],
        "store_fill_s": fill,
        "store_bytes_held": stats.bytes_held,
        "tokens_reused_per_request": prefix_len,
        "first_token_equal": tokens["vkv_reuse"] == tokens["dynamic_full"] == tokens["vkv_full"],
    }


def main_lookup(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="prefix_reuse.py lookup", description=LOOKUP_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096], help="shared prefix lengths")
    parser.add_argument("--suffix", type=int, default=32, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="requests per prefix length and cache")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_ttft.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, _ = load_default_model()
    vocab = model.config.vocab_size
    first_token(model, torch.arange(100, 116)[None])  # warm-up
    load = os.getloadavg()
    results = []
    for p in args.prefix:
        r = run(model, p, suffix=args.suffix, repeats=args.repeats, vocab=vocab)
        m = r["ttft_median_s"]
        print(f"prefix {p:5d}: dynamic full {m['dynamic_full']:.3f}s  vkv full {m['vkv_full']:.3f}s  "
              f"vkv reuse {m['vkv_reuse']:.3f}s  ({r['speedup_reuse_vs_dynamic_full']:.1f}x)  "
              f"same first token: {r['first_token_equal']}", flush=True)
        results.append(r)
    env = describe_environment(model)
    report = {
        "benchmark": "prefix_ttft",
        "model": "SmolLM2-135M-Instruct (embedded, float32)",
        "device": env["cpu_model"],
        "cpu_count": int(env["cpu_count"]),
        "torch_threads": args.threads,
        "load_average_at_start": load,
        "note": "machine shared with other processes; 1 intra-op thread so that timings do not depend on a "
                "second core being free",
        "versions": {k: env[k] for k in ("python", "torch", "transformers", "hf_vkv")},
        "command": env["command"],
        "results": results,
    }
    write_report(args.out, report)


def main(argv: list[str] | None = None) -> int | None:
    return dispatch(argv, default_main, {"exactness": main_exactness,
                                         "history": main_history,
                                         "profile": main_profile,
                                         "lookup": main_lookup})


if __name__ == "__main__":
    raise SystemExit(main())

"""Prefix reuse inside generate() on the embedded SmolLM2-135M (fp32, CPU): a chat and a document.

``chat``: a multi-turn chat with a long system prompt. Each turn runs
  * ``vkv_reuse``: ``generate(cache_implementation="vkv", cache_config={"prefix_store": store})``;
  * ``dynamic_full``: DynamicCache on the whole history (what transformers does by default);
  * ``new_alone``: DynamicCache on the turn's new tokens only (the bound the issue sets: reuse's time
    to first token should be close to prefilling only what is new);
  * ``vkv_reuse_64k``: the same through a second store whose pages are 64 KiB (fewer pages to map
    when a row starts from an entry; up to 4x more memory stranded per row);
  * ``dynamic_continued`` (the ideal column): transformers' documented workaround, a DynamicCache of
    the previous turn deep-copied (``deepcopy_s``, not counted in its TTFT) and continued: the
    same new tokens attending to the same context, with no lookup, no page bookkeeping.
  Reports per turn the time to first token (TTFT, a streamer's first token), vkv's seconds before
  the model's prefill (lookup and ``take_rows``), Python's garbage-collector pauses inside each
  timed call (``gc.callbacks``: a full collection of this process's ~420k objects takes ~0.23 s
  and lands in whichever call crosses the threshold; each timed call starts after a full
  collection, outside its time, so a pause inside it is the call's own garbage), the prompt tokens
  computed (the store's counters), the new tokens (not in the previous call's sequence), and
  whether the tokens equal DynamicCache's.

``document``: ``--batch`` different questions about one long document in one batch: vkv with an
  empty store (the document is prefilled once, then each row only its question) against DynamicCache.

Usage: ``python benchmarks/prefix_reuse.py chat --turns 20 --system-tokens 2048 --threads 1``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_vkv
from hf_vkv import PrefixStore
from hf_vkv.ab.demo_text import DOCUMENT
from hf_vkv.default_model import load_default_model
from hf_vkv.prefix.reuse import last_report
from hf_vkv.registration import cache_kwarg

from common import StepClock, write_report

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
    store = PrefixStore(model.config, budget_bytes=args.budget_mib << 20)
    # the same chat through a store of 64 KiB pages (fewer pages to map per row; more stranded)
    store_64k = PrefixStore(model.config, budget_bytes=args.budget_mib << 20, cache_config={"page_bytes": 65536})
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
        t_reuse, gc_reuse, out = ttft_gc(model, ids, mask, max_new_tokens=args.new_tokens, cache_implementation="vkv",
                                         cache_config={"prefix_store": store})
        report = last_report()
        after = store.stats()
        t_64k, gc_64k, out_64k = ttft_gc(model, ids, mask, max_new_tokens=args.new_tokens,
                                         cache_implementation="vkv", cache_config={"prefix_store": store_64k})
        row: dict[str, Any] = {
            "turn": turn + 1, "prompt_tokens": len(prompt), "new_tokens": new,
            "computed_tokens": after.prompt_tokens_computed - before.prompt_tokens_computed,
            "reused_tokens": report.reused_tokens, "ttft_s": {"vkv_reuse": t_reuse, "vkv_reuse_64k": t_64k},
            "vkv_start_s": {"vkv_reuse": report.seconds_to_start, "vkv_reuse_64k": last_report().seconds_to_start},
            "gc_pause_s": {"vkv_reuse": gc_reuse, "vkv_reuse_64k": gc_64k},
            "store_bytes_held": after.bytes_held, "store_64k_bytes_held": store_64k.stats().bytes_held,
            "tokens_equal_64k": bool(torch.equal(out, out_64k)),
        }
        new_ids = ids[:, shared:] if new else ids[:, -1:]
        row["ttft_s"]["new_alone"] = statistics.median(
            ttft(model, new_ids, torch.ones_like(new_ids), max_new_tokens=1)[0] for _ in range(3))
        row["new_alone_tokens"] = new_ids.shape[1]
        if previous_cache is not None:
            start = time.perf_counter()
            continued = copy.deepcopy(previous_cache)
            row["deepcopy_s"] = time.perf_counter() - start
            keep = min(shared, continued.get_seq_length(), len(prompt) - 1)
            if keep < continued.get_seq_length():
                continued.crop(keep - continued.get_seq_length())  # a negative count: tokens to remove
            t_cont, row["gc_pause_s"]["dynamic_continued"], _ = ttft_gc(model, ids, mask, max_new_tokens=1,
                                                                       **{cache_kwarg(): continued})
            row["ttft_s"]["dynamic_continued"] = t_cont
            del continued
        if not args.skip_dynamic:
            t_dyn, full = ttft(model, ids, mask, max_new_tokens=args.new_tokens, return_dict_in_generate=True)
            want, previous_cache = full.sequences, getattr(full, cache_kwarg())
            row["ttft_s"]["dynamic_full"] = t_dyn
            row["tokens_equal_dynamic"] = bool(torch.equal(want, out))
        alone = row["ttft_s"]["new_alone"]
        row["ttft_vs_new_alone"] = t_reuse / alone
        row["ttft_64k_vs_new_alone"] = t_64k / alone
        if "dynamic_continued" in row["ttft_s"]:
            row["ttft_vs_dynamic_continued"] = t_reuse / row["ttft_s"]["dynamic_continued"]
            row["ttft_64k_vs_dynamic_continued"] = t_64k / row["ttft_s"]["dynamic_continued"]
            row["dynamic_continued_vs_new_alone"] = row["ttft_s"]["dynamic_continued"] / alone
        turns.append(row)
        print(row, flush=True)
        answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        previous = out[0].tolist()
        for s in (store, store_64k):
            s.check_invariants()
            assert s.stats().bytes_held <= s.budget_bytes
    total_new = sum(t["new_tokens"] for t in turns)
    total_computed = sum(t["computed_tokens"] for t in turns)
    later = [t["ttft_vs_new_alone"] for t in turns[1:]]
    ideal = [t["ttft_vs_dynamic_continued"] for t in turns if "ttft_vs_dynamic_continued" in t]

    def median_of(key: str) -> float | None:
        values = [t[key] for t in turns[1:] if key in t]
        return statistics.median(values) if values else None

    def median_s(column: str, part: str = "ttft_s") -> float | None:
        values = [t[part][column] for t in turns[1:] if column in t[part]]
        return statistics.median(values) if values else None

    return {
        "medians_turns_2_on": {
            "ttft_s": {c: median_s(c) for c in ("vkv_reuse", "vkv_reuse_64k", "dynamic_continued", "new_alone",
                                                  "dynamic_full")},
            "vkv_start_s": {c: median_s(c, "vkv_start_s") for c in ("vkv_reuse", "vkv_reuse_64k")},
            "ttft_vs_new_alone": median_of("ttft_vs_new_alone"),
            "ttft_64k_vs_new_alone": median_of("ttft_64k_vs_new_alone"),
            "dynamic_continued_vs_new_alone": median_of("dynamic_continued_vs_new_alone"),
            "ttft_vs_dynamic_continued": median_of("ttft_vs_dynamic_continued"),
            "ttft_64k_vs_dynamic_continued": median_of("ttft_64k_vs_dynamic_continued"),
        },
        "turns_with_gc_pause_over_50ms": {c: [t["turn"] for t in turns if t["gc_pause_s"].get(c, 0) > 0.05]
                                         for c in ("vkv_reuse", "vkv_reuse_64k", "dynamic_continued")},
        "all_tokens_equal_64k": all(t["tokens_equal_64k"] for t in turns),
        "system_tokens": args.system_tokens, "turns": turns, "total_new_tokens": total_new,
        "total_computed_tokens": total_computed, "computed_over_new": total_computed / total_new,
        "total_prompt_tokens_dynamic": sum(t["prompt_tokens"] for t in turns),
        "max_ttft_vs_new_alone_after_turn_1": max(later) if later else None,
        "median_ttft_vs_new_alone_after_turn_1": statistics.median(later) if later else None,
        "median_ttft_vs_dynamic_continued": statistics.median(ideal) if ideal else None,
        "max_ttft_vs_dynamic_continued": max(ideal) if ideal else None,
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
                            cache_config={"prefix_store": store})
        report = last_report()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=("chat", "document"))
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--skip-dynamic", action="store_true", help="chat: no DynamicCache full re-prefill per turn")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()

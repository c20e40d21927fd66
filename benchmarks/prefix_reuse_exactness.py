"""How far prefix reuse's logits are from DynamicCache's full prefill (SmolLM2-135M, CPU).

For each dtype and thread count, ``run_ab(..., prefix_store=store)`` runs short chats (each turn
the whole conversation; vkv reuses the store, DynamicCache prefills it whole) and a
document-then-question case whose stored prefix is a prompt only (no decode-step K/V in it).
Writes, per case, whether the tokens were identical, whether the logits were bit-equal, and the
max |Δlogit|. Beam search's logits are compared beam by beam (rows of the same token history,
``StepReport.beams_unmatched`` counts the vkv beams the DynamicCache run did not hold at a step).

Usage: ``python benchmarks/prefix_reuse_exactness.py [--turns 3] [--chats 3]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_vkv
from hf_vkv import PrefixStore
from hf_vkv.ab import run_ab
from hf_vkv.ab.demo_text import DOCUMENT
from hf_vkv.default_model import load_default_model

from common import write_report

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
            report = run_ab(model, encode(tok, history), max_new_tokens=args.new_tokens, tee=False, prefix_store=store,
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
    report = run_ab(model, asked, max_new_tokens=args.new_tokens, tee=False, prefix_store=store, do_sample=False,
                    pad_token_id=tok.eos_token_id)
    return {"prompt_tokens": report.prompt_tokens, "reused_tokens": report.prefix_reuse["reused_tokens"],
            "tokens_identical": report.tokens_identical, "logits_bit_equal": report.first_divergence is None,
            "max_abs_logit_diff": report.max_abs_logit_diff,
            "prefill_logit_diff": report.steps[0].max_abs_logit_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" /
                        "prefix_reuse_exactness.json")
    args = parser.parse_args()
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
        "command": "python benchmarks/prefix_reuse_exactness.py " + " ".join(sys.argv[1:]), "results": results,
    })


if __name__ == "__main__":
    main()

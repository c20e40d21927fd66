"""Where a chat turn's time to first token goes, with a prefix store and without (SmolLM2-135M fp32, CPU).

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

Usage: ``python benchmarks/profile_prefix_turn.py --threads 2``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from hf_vkv import PrefixStore
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model
from hf_vkv.prefix.reuse import last_report
from hf_vkv.registration import cache_kwarg

from common import write_report
from prefix_reuse import USER_TURNS, long_text, ttft

RESULTS = Path(__file__).resolve().parent / "results"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=3, help="turns played before the profiled ones")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
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
                                      cache_config={"prefix_store": store}),
            "dynamic_continued": lambda: ttft(model, ids, mask, max_new_tokens=1, **{cache_kwarg(): continued}),
            "new_alone": lambda: ttft(model, new_ids, torch.ones_like(new_ids), max_new_tokens=1),
        }
        outs = {}
        for name in (calls if r % 2 == 0 else reversed(list(calls))):
            seconds, groups, outs[name] = profiled(calls[name])
            row[name] = {"ttft_s": seconds, "self_cpu_s": groups}
            if name == "vkv_reuse":
                report = last_report()
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
        "environment": describe_environment(model, command="python benchmarks/profile_prefix_turn.py "
                                            + " ".join(sys.argv[1:])),
        "torch_threads": torch.get_num_threads(), "played_turns": args.turns, "rounds": rounds, "median": median,
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
    })


if __name__ == "__main__":
    main()

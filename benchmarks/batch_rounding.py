"""Does a row of a batch-1 forward equal the same row inside a batch-N forward? (prefill once)

Prefill once (``hf_vkv.prefill_once``) runs each repeated prompt through the model once instead
of N times; its logits equal DynamicCache's only if the arithmetic of a row does not depend on
how many rows the forward has. This measures it on the embedded SmolLM2 with DynamicCache alone
(no vkv involved): the prompt's forward (``prompts x tokens`` rows per matmul) and the output
head of the last token (``logits_to_keep=1``: one row per prompt), batch 1 against batch N.

    python benchmarks/batch_rounding.py --json benchmarks/results/batch_rounding_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from common import write_report
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 3, 4, 64, 512])
    parser.add_argument("--repeats", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_default_model()[0]
    cells = []
    g = torch.Generator().manual_seed(0)
    for tokens in args.prompts:
        ids = torch.randint(100, 40000, (1, tokens), generator=g)
        for keep in (0, 1):  # 0: every token's logits (the prompt's matmuls), 1: the last token's (the head)
            with torch.no_grad():
                alone = model(ids, past_key_values=DynamicCache(config=model.config), logits_to_keep=keep).logits
                for n in args.repeats:
                    many = model(ids.repeat_interleave(n, 0), past_key_values=DynamicCache(config=model.config),
                                 logits_to_keep=keep).logits
                    diff = (alone[0] - many[0]).abs().max().item()
                    cells.append({"prompt_tokens": tokens, "logits_to_keep": keep, "batch": n,
                                  "equal": bool(torch.equal(alone[0], many[0])), "max_abs_diff": diff})
                    print(f"prompt {tokens:4d} logits_to_keep {keep} batch 1 vs {n}: equal={cells[-1]['equal']} "
                          f"max|diff| {diff:.3g}", flush=True)
    if args.json:
        write_report(Path(args.json), {"benchmark": "batch_rounding", "threads": args.threads, "cells": cells,
                                       "environment": describe_environment(model, command="python " + " ".join(sys.argv))})


if __name__ == "__main__":
    main()

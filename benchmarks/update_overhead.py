"""What the cache's own Python costs per decode step: ``VKVCache.update`` of every layer, no model.

SmolLM2-135M's geometry (30 layers, 3 KV heads of 64, float32), a batch of 4 rows holding
``--prompt`` tokens; one step is the 30 layers' ``update`` of one new token each (what a model's
attention layers call), timed over ``--steps`` steps, ``--rounds`` rounds, median. Attention is not
run, so the figure is the cache's page-table and view work alone: the part of a decode step a
refactoring of the cache can change. Used to compare two checkouts (run it in each)::

    PYTHONPATH=. python benchmarks/update_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from common import write_report
from hf_vkv import VKVCache
from hf_vkv.ab.harness import describe_environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layout", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                         intermediate_size=64, vocab_size=64, max_position_embeddings=args.prompt + args.steps * args.rounds + 8)
    shape = (args.batch, 3, 1, 64)
    rounds = []
    with torch.no_grad():
        cache = VKVCache(config, **({} if args.layout is None else {"layout": args.layout}))
        prompt = torch.randn(args.batch, 3, args.prompt, 64)
        for layer in range(30):
            cache.update(prompt, prompt, layer)
        new = torch.randn(*shape)
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                for layer in range(30):
                    cache.update(new, new, layer)
            rounds.append((time.perf_counter() - start) / args.steps * 1e6)
    result = {"us_per_step": statistics.median(rounds), "rounds_us_per_step": rounds, "layout": str(cache.layout)}
    print(f"{result['us_per_step']:.1f} us per step (30 layers' update), layout {result['layout']}; rounds {rounds}")
    if args.json:
        command = "python benchmarks/update_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(Path(args.json), {"command": command, "environment": describe_environment(command=command),
                                       "args": vars(args), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

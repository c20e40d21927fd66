"""What prefilling a chat turn's new tokens over a stored history costs any exact cache.

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

    python benchmarks/history_attention.py --history 2048 4096 --new 16 --threads 1 2 \\
        --json benchmarks/results/history_attention.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from common import write_report
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()

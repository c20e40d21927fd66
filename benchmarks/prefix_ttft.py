"""Time to first token with and without prefix reuse, on the embedded SmolLM2-135M (fp32, CPU).

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

    python benchmarks/prefix_ttft.py                        # 1k and 4k prefixes (a few minutes)
    python benchmarks/prefix_ttft.py --prefix 256 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import hf_vkv
from common import write_report  # benchmarks/common.py
from hf_vkv.ab.harness import describe_environment
from hf_vkv.default_model import load_default_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096], help="shared prefix lengths")
    parser.add_argument("--suffix", type=int, default=32, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="requests per prefix length and cache")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_ttft.json")
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()

"""What only vkv can run: a batch whose KV DynamicCache cannot hold in this machine's memory.

    python benchmarks/only_vkv.py --json benchmarks/results/only_vkv.json

``rows`` questions about one document: every row is the same ``--prompt`` tokens followed by
``--suffix`` tokens of its own, greedy, ``--new-tokens`` each, with a ``PrefixStore`` (so vkv
prefills the shared document once and every row maps its pages). The store is token-major: its
rows take its layout, and 128 rows of 48 x 2 x 32 head-major sub-rows would need ~1.2 million
kernel mappings (with a default store the call runs without it, its reuse report naming this
option, and without the document shared its rows would not fit in memory). The model is a llama with random
weights whose KV is heavy and whose compute is light (``--layers`` x ``--kv-heads`` x
``--head-dim``, hidden 64: 3 MiB of float32 KV a token at the defaults), so DynamicCache's
failure comes within minutes on two CPU cores rather than after an hour of prefill.

Three runs, each in its own process, one after another:

* **vkv**, all rows: time, tokens, the pool's resident KV bytes and the process's peak RSS (which
  counts a shared page once per row that maps it; the pool's bytes are the memory);
* **DynamicCache**, all rows, in a child whose address space is capped at the machine's physical
  memory (``RLIMIT_AS = MemTotal``), so that running out is torch's out-of-memory error, caught
  and recorded, not the kernel's OOM killer picking a process. vkv cannot run under that cap (its
  reservations are address space without memory), which is why it runs uncapped; its resident
  bytes are the comparison;
* **DynamicCache**, the first ``--check-rows`` rows (what fits): their tokens are compared with
  vkv's rows (``torch.equal``); the logits' max |delta| is reported (the two runs differ in batch
  size, which may change a matmul's last bits).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
import traceback
from pathlib import Path

import torch

from common import write_report  # noqa: E402


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def make_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                         num_attention_heads=args.kv_heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def inputs(args: argparse.Namespace, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(10, 1024, (1, args.prompt), generator=g).expand(rows, -1)
    own = torch.randint(10, 1024, (args.rows, args.suffix), generator=g)[:rows]
    return torch.cat([doc, own], dim=1)


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    return 2 * args.layers * args.kv_heads * args.head_dim * 4


def run(kind: str, args: argparse.Namespace, rows: int, cap: int | None, out: mp.Queue) -> None:
    """One run in a child process; puts a result dict on ``out``."""
    r: dict = {"kind": kind, "rows": rows, "address_space_cap_bytes": cap}
    try:
        torch.set_num_threads(args.threads)
        import hf_vkv

        model = make_model(args)
        ids = inputs(args, rows)
        kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)
        if kind == "vkv":
            store = hf_vkv.PrefixStore(model.config, cache_config={"layout": "token_major"})
            kwargs.update(cache_implementation="vkv", cache_config={"prefix_store": store})
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        r["seconds"] = time.perf_counter() - t0
        r["tokens"] = gen.sequences[:, ids.shape[1]:].tolist()
        r["logits"] = [x[: args.check_rows].tolist() for x in gen.logits]
        if kind == "vkv":
            stats = gen.past_key_values.stats()
            report = hf_vkv.reuse_report(gen)
            r["kv_resident_bytes"] = stats.pool_resident_bytes
            r["layouts"] = [g.layout for g in stats.groups]
            r["reuse"] = {"common_prefix_tokens": report.common_prefix_tokens, "computed_tokens": report.computed_tokens,
                          "prompt_tokens": report.prompt_tokens}
        else:
            r["kv_bytes"] = sum(t.numel() * t.element_size() for layer in gen.past_key_values.layers
                                for t in (layer.keys, layer.values))
        r["ok"] = True
    except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory is a RuntimeError
        r.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}", seconds=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001  (recorded, the benchmark goes on)
        r.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}", traceback=traceback.format_exc()[-1500:])
    r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.put(r)


def in_child(kind: str, args: argparse.Namespace, rows: int, cap: int | None) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=run, args=(kind, args, rows, cap, q))
    p.start()
    try:
        r = q.get(timeout=args.timeout)
    except Exception:  # noqa: BLE001  (no result: the child died or hung)
        r = {"kind": kind, "rows": rows, "ok": False, "error": "no result from the child"}
    p.join(timeout=60)
    r["exit_code"] = p.exitcode
    print(kind, rows, "rows:", "ok" if r.get("ok") else r.get("error"), f"{r.get('seconds', 0):.1f} s", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=96, help="shared document tokens")
    ap.add_argument("--suffix", type=int, default=4, help="each row's own tokens after the document")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--check-rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one child")
    ap.add_argument("--skip-dynamic", action="store_true", help="vkv only (a smoke run)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    total = mem_total()
    per_token = kv_bytes_per_token(args)
    tokens = args.prompt + args.suffix + args.new_tokens
    report: dict = {
        "benchmark": "only_vkv", "command": "python " + " ".join(sys.argv),
        "model": f"llama, random weights, hidden 64, {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, fp32",
        "threads": args.threads, "torch": torch.__version__, "mem_total_bytes": total,
        "kv_bytes_per_token": per_token, "rows": args.rows, "prompt": args.prompt, "suffix": args.suffix,
        "new_tokens": args.new_tokens,
        "limit_bytes": (args.prompt + args.rows * (args.suffix + args.new_tokens)) * per_token,
        "dynamic_kv_bytes_needed": args.rows * tokens * per_token,
    }
    vkv = in_child("vkv", args, args.rows, None)
    report["vkv"] = vkv
    if not args.skip_dynamic:
        report["dynamic_all_rows"] = in_child("dynamic", args, args.rows, total)
        check = in_child("dynamic", args, args.check_rows, total)
        report["dynamic_check_rows"] = check
        if vkv.get("ok") and check.get("ok"):
            mine = torch.tensor(vkv["tokens"][: args.check_rows])
            ref = torch.tensor(check["tokens"])
            report["check"] = {
                "rows": args.check_rows, "tokens_identical": bool(torch.equal(mine, ref)),
                "max_abs_logit_diff": max(float((torch.tensor(a) - torch.tensor(b)).abs().max())
                                          for a, b in zip(vkv["logits"], check["logits"])),
            }
    for part in ("vkv", "dynamic_all_rows", "dynamic_check_rows"):
        report.get(part, {}).pop("logits", None)
    print(json.dumps({k: v for k, v in report.items() if k not in ("vkv", "dynamic_all_rows", "dynamic_check_rows")},
                     indent=1))
    if args.json:
        write_report(args.json, report)
    return 0 if report.get("check", {}).get("tokens_identical", args.skip_dynamic) else 1


if __name__ == "__main__":
    raise SystemExit(main())

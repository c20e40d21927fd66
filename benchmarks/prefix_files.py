"""Mapped prefix files on the embedded SmolLM2-135M (fp32, CPU): open time, first-turn TTFT in a
fresh process, and memory shared by processes that map one file.

    python benchmarks/prefix_files.py --tokens 2048 --threads 1 --json benchmarks/results/prefix_files_1t.json

A store holding one ``--tokens``-token prefix (a system prompt) is saved with
``PrefixStore.save``. Then, each in a child process of its own that loads the model and runs one
unrelated warm-up generate first (so every column pays the same process start-up):

* ``open``: ``PrefixStore.load(folder)`` of the mapped file, ``--repeats`` times into fresh stores,
  each 0.1 s after the last (whose check of the pages in the background has ended by then: each
  open is timed as a process's open, not beside the previous one's check); the weights
  fingerprint, which ``load`` takes, is taken just before each as well (what it costs cold is
  ``fingerprint_after_pause_s``);
* ``fingerprint_after_pause_s`` (same child): the model's weights fingerprint taken 0.3 s after
  the last call, 11 times alternating its sample (runs of 32 consecutive values) with the one of
  earlier versions (256 evenly spaced values): the weights are no longer in the processor's
  caches and TLB then, as in a call a user makes after a pause;
* ``fresh``: the first turn (the prefix + ``--question`` new tokens, one token generated) in a
  process that just opened the file: the turn checks the pages the background check started by
  the open has not reached yet, and faults them in. Its time to
  first token is taken when ``generate`` hands the token to a streamer (what a chat shows the user
  first); ``call_s`` is the whole call, with what follows the token (the store's insert of the
  conversation);
* ``ahead``: the same, the turn coming ``--ahead-s`` seconds after the open (a server that opened
  the file at its start, a chat resumed while its user types): the pages were checked meanwhile,
  by the check the open starts in the background;
* ``warm``: the same turn in a process whose store computed the prefix itself (held in memory);
* ``prefill``: the same turn with DynamicCache over the whole prompt (no reuse);
* ``continued``: the same turn with a DynamicCache that already holds the prefix (computed in the
  child before the clock starts), continued over the new tokens: the turn's own work, what no
  cache that reuses the prefix can undercut (transformers' idiom for reusing a cache by hand);
* ``pss``: 1, 2 and 4 processes that open the file and run the turn at once, each reading its
  ``/proc/self/smaps`` while all hold the pages: the summed Pss of the mappings of
  ``prefix_store.kv`` against one copy of the prefix's pages; and the same with the prefix loaded
  by copy (a ``save_prefix`` file read into the store: the Pss of each process's memfd pages).

Each timed column is the median over ``--repeats`` child processes, the columns interleaved
(a round runs one child of each); the ratios are given both as the ratio of the columns' medians
and as the median of the rounds' own ratios (``*_round_median``: what drift of the machine's speed
between rounds moves least).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from common import write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, sys, time, statistics
import torch
torch.set_num_threads({threads})
import hf_vkv
from hf_vkv import PrefixStore, load_prefix
from hf_vkv.default_model import load_default_model
model, tok = load_default_model()
prefix = {prefix!r}
question = {question!r}
ids = torch.tensor([prefix + question])
from transformers.generation.streamers import BaseStreamer
class FirstToken(BaseStreamer):
    # generate() puts the prompt first, then each new token as soon as it is chosen
    def __init__(self):
        self.puts, self.at = 0, None
    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()
    def end(self):
        pass
calls = []
def turn(store=None, **extra):  # with store: vkv reusing it; else generate's default cache, or extra's
    if store is not None:
        extra.update(cache_implementation="vkv", cache_config={{"prefix_store": store}})
    first = FirstToken()
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, streamer=first, **extra)
    calls.append(time.perf_counter() - t)  # the whole call: with what follows the token (the store's insert)
    return first.at - t
warm_ids = torch.tensor([question * 4])
model.generate(warm_ids, attention_mask=torch.ones_like(warm_ids), max_new_tokens=2, do_sample=False)  # warm-up
mode = {mode!r}
out = {{}}
def pss(path_part):
    total, current = 0, None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            current = parts[5] if len(parts) > 5 else ""
        elif parts and parts[0] == "Pss:" and current is not None and path_part in current:
            total += int(parts[1]) * 1024
    return total
if mode == "open":
    store = PrefixStore(model.config)
    store.fingerprint(model)
    times = []
    for _ in range({repeats}):
        time.sleep(0.1)  # the last open's background check has ended (~10 ms): an open in a process, not beside another's check
        s = PrefixStore(model.config)
        s.fingerprint(model)
        t = time.perf_counter(); s.load({folder!r}, model=model); times.append(time.perf_counter() - t)
    out["open_s"] = times
    from hf_vkv.prefix.fingerprint import weights_identity
    took = {{"runs": [], "evenly_spaced": []}}  # the sample taken now, and the one before (blocks=256)
    for i in range(11):
        for name, blocks in ((("runs", 8), ("evenly_spaced", 256)) if i % 2 else (("evenly_spaced", 256), ("runs", 8))):
            time.sleep(0.3)  # what a call after a pause pays: the weights are no longer in the caches and TLB
            t = time.perf_counter(); weights_identity(model, blocks=blocks); took[name].append(time.perf_counter() - t)
    out["fingerprint_after_pause_s"] = took
elif mode == "fresh":
    store = PrefixStore(model.config)
    store.fingerprint(model)
    t = time.perf_counter(); store.load({folder!r}, model=model); out["open_s"] = time.perf_counter() - t
    out["ttft_s"] = turn(store)
    out["reused"] = store.stats().tokens_reused
elif mode == "ahead":
    store = PrefixStore(model.config)
    store.fingerprint(model)
    t = time.perf_counter(); store.load({folder!r}, model=model); out["open_s"] = time.perf_counter() - t
    time.sleep({ahead_s})  # the turn comes later than the open: the background check has finished
    out["ttft_s"] = turn(store)
    out["reused"] = store.stats().tokens_reused
elif mode == "warm":
    store = PrefixStore(model.config)
    p = torch.tensor([prefix])
    model.generate(p[:, :-1], attention_mask=torch.ones_like(p[:, :-1]), max_new_tokens=1, do_sample=False,
                   cache_implementation="vkv", cache_config={{"prefix_store": store}})
    out["ttft_s"] = turn(store)
    out["reused"] = store.stats().tokens_reused
elif mode == "prefill":
    out["ttft_s"] = turn()
elif mode == "continued":
    from transformers import DynamicCache
    held = DynamicCache(config=model.config)
    p = torch.tensor([prefix])
    with torch.no_grad():
        model(p[:, :-1], past_key_values=held, use_cache=True)
    out["ttft_s"] = turn(past_key_values=held)
elif mode in ("pss-mapped", "pss-copied"):
    store = PrefixStore(model.config)
    if mode == "pss-mapped":
        store.load({folder!r}, model=model)
    else:
        store.load({copy_file!r}, model=model)
    out["ttft_s"] = turn(store)
    out["reused"] = store.stats().tokens_reused
    open({barrier!r} + "." + str(os.getpid()), "w").close()
    deadline = time.time() + 120
    while len([f for f in os.listdir(os.path.dirname({barrier!r})) if f.startswith(os.path.basename({barrier!r}) + ".")]) < {procs} and time.time() < deadline:
        time.sleep(0.05)
    out["pss_file"] = pss("prefix_store.kv")
    out["pss_memfd"] = pss("memfd:")
    open({barrier!r} + "-done." + str(os.getpid()), "w").close()
    while len([f for f in os.listdir(os.path.dirname({barrier!r})) if f.startswith(os.path.basename({barrier!r}) + "-done.")]) < {procs} and time.time() < deadline:
        time.sleep(0.05)
if calls:
    out["call_s"] = calls[-1]
print("RESULT " + json.dumps(out), flush=True)
"""


def _child(mode: str, args: argparse.Namespace, common: dict[str, Any], *, procs: int = 1, barrier: str = "",
           repeats: int = 1) -> list[subprocess.Popen]:
    code = _CHILD.format(mode=mode, threads=args.threads, repeats=repeats, procs=procs, barrier=barrier,
                         ahead_s=args.ahead_s, **common)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env) for _ in range(procs)]


def _results(children: list[subprocess.Popen]) -> list[dict[str, Any]]:
    out = []
    for c in children:
        stdout, stderr = c.communicate(timeout=600)
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        if c.returncode != 0 or line is None:
            raise RuntimeError(f"child failed ({c.returncode}): {stderr[-2000:]}")
        out.append(json.loads(line[len("RESULT "):]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--question", type=int, default=32, help="new tokens of the turn")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--ahead-s", type=float, default=0.3,
                   help="seconds between the open and the turn in the 'ahead' column")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_files.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from hf_vkv import PrefixStore, save_prefix
    from hf_vkv.ab.harness import describe_environment
    from hf_vkv.default_model import load_default_model

    model, _ = load_default_model()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, model.config.vocab_size - 1, (args.tokens,), generator=g).tolist()
    question = torch.randint(100, model.config.vocab_size - 1, (args.question,), generator=g).tolist()
    work = Path(tempfile.mkdtemp(prefix="hf_vkv_prefix_files_"))
    store = PrefixStore(model.config)
    ids = torch.tensor([prefix])
    out = model.generate(ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1]), max_new_tokens=1, do_sample=False,
                         cache_implementation="vkv", cache_config={"prefix_store": store}, return_dict_in_generate=True)
    store.save(work / "store", model=model)
    kv_file = work / "store" / "prefix_store.kv"
    index = json.loads((work / "store" / "prefix_store.json").read_text())
    one_copy = index["mapped"]["pages"] * index["mapped"]["page_bytes"]
    cache = out.past_key_values
    n = cache.get_seq_length()
    copy_file = save_prefix(work / "copy.safetensors", cache, out.sequences[0, :n], model=model)
    common = dict(prefix=prefix, question=question, folder=str(work / "store"), copy_file=str(copy_file))
    report: dict[str, Any] = dict(
        benchmark="prefix_files", command=" ".join([sys.executable, *sys.argv]), environment=describe_environment(model),
        threads=args.threads, prefix_tokens=args.tokens, stored_tokens=n, question_tokens=args.question,
        file_bytes=kv_file.stat().st_size, one_copy_bytes=one_copy, page_bytes=index["mapped"]["page_bytes"])
    print(f"prefix {n} tokens stored, {one_copy / 2**20:.1f} MiB of pages; file {kv_file.stat().st_size / 2**20:.1f} MiB")
    opened = _results(_child("open", args, common, repeats=max(args.repeats, 5)))[0]
    report["open_s"] = opened["open_s"]
    print(f"open: median {1e3 * statistics.median(report['open_s']):.2f} ms of {report['open_s']}")
    report["fingerprint_after_pause_s"] = opened["fingerprint_after_pause_s"]
    print("fingerprint after a 0.3 s pause, median: " + ", ".join(
        f"{name} {1e3 * statistics.median(v):.2f} ms" for name, v in report["fingerprint_after_pause_s"].items()))
    cols: dict[str, list[dict[str, Any]]] = {"fresh": [], "ahead": [], "warm": [], "prefill": [], "continued": []}
    for _ in range(args.repeats):  # interleaved
        for mode in cols:
            cols[mode].extend(_results(_child(mode, args, common)))
    for mode, runs in cols.items():
        report[mode] = runs
        report[f"{mode}_ttft_s"] = statistics.median(r["ttft_s"] for r in runs)
        report[f"{mode}_call_s"] = statistics.median(r["call_s"] for r in runs)
        print(f"{mode:8s} TTFT median {report[f'{mode}_ttft_s']:.4f} s of {[round(r['ttft_s'], 4) for r in runs]} "
              f"(whole call {report[f'{mode}_call_s']:.4f} s)")
    report["ahead_s"] = args.ahead_s
    report["ahead_over_warm"] = report["ahead_ttft_s"] / report["warm_ttft_s"]
    report["ahead_over_prefill"] = report["ahead_ttft_s"] / report["prefill_ttft_s"]
    report["ahead_over_prefill_round_median"] = statistics.median(
        a["ttft_s"] / p["ttft_s"] for a, p in zip(cols["ahead"], cols["prefill"]))
    report["fresh_over_warm"] = report["fresh_ttft_s"] / report["warm_ttft_s"]
    report["fresh_over_prefill"] = report["fresh_ttft_s"] / report["prefill_ttft_s"]
    # the columns ran interleaved, a round each: the median of each round's ratio is what a
    # machine whose speed drifts between rounds (this one's, by 10-25 %) moves least
    report["continued_over_prefill"] = report["continued_ttft_s"] / report["prefill_ttft_s"]
    rounds = list(zip(cols["fresh"], cols["warm"], cols["prefill"]))
    report["fresh_over_warm_per_round"] = [f["ttft_s"] / w["ttft_s"] for f, w, _ in rounds]
    report["fresh_over_prefill_per_round"] = [f["ttft_s"] / p["ttft_s"] for f, _, p in rounds]
    report["fresh_over_warm_round_median"] = statistics.median(report["fresh_over_warm_per_round"])
    report["fresh_over_prefill_round_median"] = statistics.median(report["fresh_over_prefill_per_round"])
    report["continued_over_prefill_round_median"] = statistics.median(
        c["ttft_s"] / p["ttft_s"] for c, p in zip(cols["continued"], cols["prefill"]))
    print(f"fresh/warm {report['fresh_over_warm']:.3f} (median of the rounds' ratios "
          f"{report['fresh_over_warm_round_median']:.3f}), fresh/prefill {report['fresh_over_prefill']:.4f} "
          f"({report['fresh_over_prefill_round_median']:.4f}); a DynamicCache holding the prefix, continued: "
          f"{report['continued_over_prefill']:.4f} ({report['continued_over_prefill_round_median']:.4f}) of the prefill")
    print(f"opened {args.ahead_s} s ahead: /warm {report['ahead_over_warm']:.3f}, /prefill {report['ahead_over_prefill']:.4f} "
          f"({report['ahead_over_prefill_round_median']:.4f})")
    report["pss"] = []
    for procs in args.procs:
        for mode in ("pss-mapped", "pss-copied"):
            barrier = str(work / f"barrier-{mode}-{procs}")
            runs = _results(_child(mode, args, common, procs=procs, barrier=barrier))
            key = "pss_file" if mode == "pss-mapped" else "pss_memfd"
            total = sum(r[key] for r in runs)
            row = dict(mode=mode, processes=procs, total_pss_bytes=total, over_one_copy=total / one_copy,
                       per_process=[r[key] for r in runs], reused=[r["reused"] for r in runs])
            report["pss"].append(row)
            print(f"{mode} x{procs}: total Pss {total / 2**20:.1f} MiB = {total / one_copy:.2f}x one copy")
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

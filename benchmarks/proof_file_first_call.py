"""A first call of prefill once in a fresh process, with and without row-exactness proofs kept on
disk (``HF_VKV_PROOF_CACHE``, :mod:`hf_vkv.generate.proof_file`), against DynamicCache.

    HF_HUB_OFFLINE=1 python benchmarks/proof_file_first_call.py --prompts 512 2048 --threads 2 \\
        --json benchmarks/results/proof_file_first_call_t2.json

For each prompt length, four fresh processes, one after another (the embedded SmolLM2-135M, fp32,
``--rows`` sampled rows, seed 0, time to first token = ``generate(max_new_tokens=1)``; each process
first runs the same short greedy warm-up):

* ``dynamic``: DynamicCache's first call;
* ``vkv_cold``: vkv's first call with an empty proof file (every signature proved, then kept);
* ``vkv_kept``: vkv's first call in a new process that reads that file (nothing proved);
* ``vkv_off``: vkv's first call with ``HF_VKV_PROOF_CACHE=off``, then its second call (the
  steady state: every verdict in the process).

Each process writes its first call's logits; ``vkv_kept`` / ``vkv_cold`` logits are compared with
DynamicCache's bit for bit (``torch.equal``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads({threads})
import hf_vkv
from hf_vkv.default_model import load_default_model
model, _ = load_default_model()
g = torch.Generator().manual_seed({tokens})
ids = torch.randint(100, model.config.vocab_size - 1, (1, {tokens}), generator=g)
warm = torch.randint(100, model.config.vocab_size - 1, (1, 16), generator=g)
model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False)
extra = {{}} if {cache!r} == "dynamic" else dict(cache_implementation="vkv")
def call():
    torch.manual_seed(0)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=True,
                         num_return_sequences={rows}, return_dict_in_generate=True, output_logits=True, **extra)
    return time.perf_counter() - t, out.logits[0]
first, logits = call()
torch.save(logits, {logits_path!r})
out = dict(first_s=first)
if {second}:
    out["second_s"] = call()[0]
print(json.dumps(out))
"""


def _run(cache: str, *, tokens: int, threads: int, rows: int, proofs: str, logits: Path, second: bool = False) -> dict:
    code = _CHILD.format(threads=threads, tokens=tokens, cache=cache, rows=rows, logits_path=str(logits),
                         second=second)
    env = {**os.environ, "HF_VKV_PROOF_CACHE": proofs, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    if child.returncode:
        raise RuntimeError(child.stderr[-3000:])
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "proof_file_first_call.json")
    args = p.parse_args()
    from hf_vkv.ab.harness import describe_environment
    from hf_vkv.default_model import load_default_model

    model, _ = load_default_model()
    report = dict(benchmark="proof_file_first_call", command=" ".join([sys.executable, *sys.argv]),
                  environment=describe_environment(model), threads=args.threads, rows=args.rows, cells=[])
    del model
    work = Path(tempfile.mkdtemp(prefix="hf_vkv_proofs_"))
    for tokens in args.prompts:
        proofs = work / f"proofs_{tokens}.jsonl"
        cell: dict = dict(prompt_tokens=tokens)
        for name, cache, file, second in [("dynamic", "dynamic", "off", False), ("vkv_cold", "vkv", str(proofs), False),
                                          ("vkv_kept", "vkv", str(proofs), False), ("vkv_off", "vkv", "off", True)]:
            cell[name] = _run(cache, tokens=tokens, threads=args.threads, rows=args.rows, proofs=file,
                              logits=work / f"{name}_{tokens}.pt", second=second)
            print(tokens, name, cell[name], flush=True)
        ref = torch.load(work / f"dynamic_{tokens}.pt")
        for name in ("vkv_cold", "vkv_kept", "vkv_off"):
            cell[name]["logits_equal_dynamic"] = bool(torch.equal(torch.load(work / f"{name}_{tokens}.pt"), ref))
        cell["kept_proofs"] = len(proofs.read_text().splitlines()) if proofs.exists() else 0
        dyn = cell["dynamic"]["first_s"]
        cell["vs_dynamic"] = {name: cell[name]["first_s"] / dyn for name in ("vkv_cold", "vkv_kept", "vkv_off")}
        cell["vs_dynamic"]["vkv_second"] = cell["vkv_off"]["second_s"] / dyn
        print(tokens, json.dumps(cell["vs_dynamic"]), flush=True)
        report["cells"].append(cell)
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

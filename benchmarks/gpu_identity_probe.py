"""Where vkv's tokens leave DynamicCache's on a GPU, and why: a probe, not a benchmark.

    python3 benchmarks/gpu_identity_probe.py --json benchmarks/results/gpu_identity_probe.json

Runs greedy generate() on the SmolLM2-shaped random llama of ``gpu_generate.py`` (bf16, sdpa) for a
few batch sizes without padding, with DynamicCache (twice: is the reference itself deterministic?),
StaticCache, vkv token-major, vkv head-major, and vkv token-major with K and V made contiguous
before attention. For each run: tokens equal to the first DynamicCache run, the first (step, row)
that differs, max |Δlogit| at the first step and over the steps before the first difference, and
what ``scaled_dot_product_attention`` was called with at prefill and at the first decode step (K's
strides, the mask, is_causal, enable_gqa, and the fused kernel torch chooses for those arguments).
With `vkv-paged` (and `vkv-paged-fused`: the fused Triton kernel), the pages are read through
block tables (`attn_implementation="vkv_paged"`); each run records its wall time. Then, in a child process, whether ``cuMemUnmap`` itself waits for a kernel still reading the range
(its wall time after a queued ~0.2 s sleep kernel, and whether the read faulted).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import write_report  # noqa: E402
from gpu_generate import load_model  # noqa: E402

import hf_vkv  # noqa: E402,F401  (registers cache_implementation="vkv")
from hf_vkv.ab.harness import describe_environment  # noqa: E402

VARIANTS = {
    "dynamic": {},
    "dynamic-again": {},
    "static": {"cache_implementation": "static", "disable_compile": True},
    "vkv-token": {"cache_implementation": "vkv", "cache_config": {"layout": "token_major"}},
    "vkv-head": {"cache_implementation": "vkv", "cache_config": {"layout": "head_major"}},
    "vkv-token-contiguous": {"cache_implementation": "vkv", "cache_config": {"layout": "token_major"}},
    # under attn_implementation="vkv_paged": the fused Triton kernel (the default of the first run,
    # gpu_paged_probe.json's "vkv-paged"), and the default since, gather + sdpa
    "vkv-paged-fused": {"cache_implementation": "vkv", "cache_config": {"paged_kernel": "fused"}},
    "vkv-paged": {"cache_implementation": "vkv"},
}

_UNMAP = """
import time, torch
from hf_vkv.cuda import CudaBackend
from hf_vkv.memory import PageId
b = CudaBackend(torch.device("cuda", 0), create_ahead=1, max_pages=4)
b.ensure_id_space(1)
b.create([PageId(0)])
base = b.reserve(b.page_bytes)
b.map(base, [PageId(0)])
view = b.tensor(base, b.page_bytes, None)
view.fill_(1)
torch.cuda.synchronize()
t = time.perf_counter(); torch.cuda._sleep(400_000_000); torch.cuda.synchronize(); sleep_s = time.perf_counter() - t
torch.cuda._sleep(400_000_000)
total = view.sum(dtype=torch.int64)
t = time.perf_counter()
b._driver.unmap(base, b.page_bytes)
unmap_s = time.perf_counter() - t
torch.cuda.synchronize()
print("sleep_s", sleep_s, "unmap_s", unmap_s, "total", int(total), flush=True)
"""


class SdpaLog:
    """Wraps F.scaled_dot_product_attention (transformers calls it through the module attribute)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.contiguous = False
        self.original = F.scaled_dot_product_attention

    def __enter__(self) -> "SdpaLog":
        original = self.original

        def wrapper(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            if self.contiguous:
                k, v = k.contiguous(), v.contiguous()
            if len(self.calls) < 64:
                try:
                    choice = int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
                except Exception as exc:  # noqa: BLE001
                    choice = f"{type(exc).__name__}: {exc}"[:120]
                self.calls.append(dict(
                    q=list(q.shape), k=list(k.shape), k_stride=list(k.stride()), k_contiguous=k.is_contiguous(),
                    v_stride=list(v.stride()), mask=None if attn_mask is None else [list(attn_mask.shape), str(attn_mask.dtype)],
                    is_causal=bool(is_causal), enable_gqa=bool(enable_gqa), fused_choice=choice,
                    k_ptr_mod_256=k.data_ptr() % 256))
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                            enable_gqa=enable_gqa)

        F.scaled_dot_product_attention = wrapper
        torch.nn.functional.scaled_dot_product_attention = wrapper
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self.original
        torch.nn.functional.scaled_dot_product_attention = self.original


def run(model, ids, variant: str, new_tokens: int) -> dict:
    kwargs = dict(VARIANTS[variant])
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    paged = variant.startswith("vkv-paged")
    if paged:
        model.set_attn_implementation("vkv_paged")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    with SdpaLog() as log, torch.inference_mode():
        log.contiguous = variant.endswith("contiguous")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                             output_logits=True, pad_token_id=model.generation_config.eos_token_id, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    if paged:
        model.set_attn_implementation("sdpa")
    layers = model.config.num_hidden_layers
    return dict(sequences=out.sequences.cpu(), logits=[x.float().cpu() for x in out.logits], wall_s=wall_s,
                prefill_call=log.calls[0] if log.calls else None,
                decode_call=log.calls[layers] if len(log.calls) > layers else None)


def compare(ref: dict, got: dict, prompt_len: int) -> dict:
    a, b = ref["sequences"][:, prompt_len:], got["sequences"][:, prompt_len:]
    diff = (a != b).nonzero().tolist()
    first = min(diff, key=lambda rc: (rc[1], rc[0])) if diff else None  # (row, step)
    upto = first[1] if first else len(ref["logits"])
    deltas = [float((x - y).abs().max()) for x, y in zip(ref["logits"][:upto + 1], got["logits"][:upto + 1])]
    return dict(tokens_identical=not diff, first_difference=None if first is None else dict(row=first[0], step=first[1]),
                rows_differing=sorted({r for r, _ in diff}), max_dlogit_step0=deltas[0] if deltas else None,
                max_dlogit_before_difference=max(deltas[:-1] or [0.0]) if first else max(deltas or [0.0]),
                max_dlogit_at_difference=deltas[-1] if first and deltas else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/gpu_identity_probe.json"))
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the probe itself")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--no-unmap-probe", action="store_true", help="skip the child process that times cuMemUnmap")
    p.add_argument("--kernels", choices=("default", "deterministic", "no-cudnn"), default="default",
                   help="torch's default kernels, torch.use_deterministic_algorithms(True), or cuDNN attention off")
    args = p.parse_args()
    if args.kernels == "deterministic":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    elif args.kernels == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_identity_probe.py needs a CUDA GPU (--device cpu: a smoke run)")
    model, name = load_model("smollm2-random", torch.bfloat16, device=args.device)
    report = dict(benchmark="gpu_identity_probe", command=" ".join(sys.argv), environment=describe_environment(model),
                  model=name, dtype="bf16", kernels=args.kernels, context=args.context, new_tokens=args.new_tokens, cells=[])
    vocab = model.config.vocab_size
    warm = torch.randint(10, vocab, (1, 64), generator=torch.Generator().manual_seed(1)).to(args.device)
    for v in args.variants:
        run(model, warm, v, 4)
    for batch in args.batches:
        gen = torch.Generator().manual_seed(args.context * 31 + batch)  # gpu_generate.py's prompts
        ids = torch.randint(10, vocab, (batch, args.context), generator=gen).to(args.device)
        ref = run(model, ids, "dynamic", args.new_tokens)
        cell = dict(batch=batch, dynamic_prefill_call=ref["prefill_call"], dynamic_decode_call=ref["decode_call"],
                    dynamic_wall_s=ref["wall_s"], runs={})
        for v in args.variants:
            if v == "dynamic":
                continue
            got = run(model, ids, v, args.new_tokens)
            cell["runs"][v] = dict(compare(ref, got, ids.shape[1]), prefill_call=got["prefill_call"],
                                   decode_call=got["decode_call"], wall_s=got["wall_s"])
            r = cell["runs"][v]
            print(f"batch {batch:2d} {v:22s} identical {r['tokens_identical']!s:5s} first {r['first_difference']} "
                  f"dlogit0 {r['max_dlogit_step0']:.3g} before {r['max_dlogit_before_difference']:.3g} "
                  f"wall {r['wall_s']:.2f} s (dynamic {ref['wall_s']:.2f} s)", flush=True)
        report["cells"].append(cell)
        write_report(args.json, report)
    if args.device != "cuda" or args.no_unmap_probe:
        return 0
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _UNMAP], capture_output=True, text=True, timeout=120)
    report["unmap_probe"] = dict(returncode=proc.returncode, stdout=proc.stdout[-1000:], stderr=proc.stderr[-1500:],
                                 wall_s=time.perf_counter() - t)
    print("unmap probe:", proc.returncode, proc.stdout.strip(), proc.stderr.strip()[-300:], flush=True)
    write_report(args.json, report)
    print(json.dumps({k: report["cells"][-1][k] for k in ("dynamic_prefill_call", "dynamic_decode_call")}, indent=None))
    for c in report["cells"]:
        for v, r in c["runs"].items():
            print(c["batch"], v, "prefill", r["prefill_call"], "\n   decode", r["decode_call"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Token-major's decode step with its views read in place against contiguous copies of them, and
head-major's, on the embedded SmolLM2-135M (fp32, CPU, SDPA).

    HF_HUB_OFFLINE=1 python benchmarks/token_major_reads.py --threads 1 2 --cells 8@512 8@2048 \
        --json benchmarks/results/token_major_reads.json

Per cell ``n@P`` (n rows sampled from one P-token prompt of random tokens, ``--new`` tokens
each) and thread count, ``--rounds`` rounds, each one ``generate`` per variant, the order
reversed every other round: ``copy``, token-major handing attention contiguous copies of its
views at every step (what the host did before SDPA was found to read aligned strided views
exactly: ``hf_vkv.cache.sources.reads_need_contiguous`` forced true); ``view``, token-major as it
is now (the views themselves); ``head``, head-major. Decode step: the median gap between two
logits-processor calls of a run; the cell's figure, the median over the rounds. Check: the three
variants' sequences and every step's logits ``torch.equal`` in every round (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("copy", "view", "head")


class _Marks:
    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _cell(model: Any, rows: int, prompt: int, *, new: int, rounds: int) -> dict[str, Any]:
    import hf_vkv.cache.sources as sources
    from transformers import LogitsProcessorList

    ids = torch.randint(100, model.config.vocab_size - 1, (1, prompt), generator=torch.Generator().manual_seed(0))
    exact = sources.reads_need_contiguous
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    identical = True
    try:
        for r in range(rounds):
            outs = {}
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                sources.reads_need_contiguous = (lambda config, geometry: True) if variant == "copy" else exact
                marks = _Marks()
                torch.manual_seed(r)
                outs[variant] = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=True,
                    num_return_sequences=rows, cache_implementation="vkv", output_logits=True,
                    return_dict_in_generate=True, logits_processor=LogitsProcessorList([marks]),
                    cache_config={"layout": "head_major" if variant == "head" else "token_major"})
                steps[variant].append(statistics.median(b - a for a, b in zip(marks.times[1:], marks.times[2:])))
            ref = outs["copy"]
            identical &= all(torch.equal(ref.sequences, o.sequences) and len(ref.logits) == len(o.logits)
                             and all(torch.equal(a, b) for a, b in zip(ref.logits, o.logits)) for o in outs.values())
    finally:
        sources.reads_need_contiguous = exact
    out: dict[str, Any] = {"rows": rows, "prompt": prompt, "new_tokens": new, "identical": identical}
    for variant in VARIANTS:
        out[f"{variant}_step_s"] = statistics.median(steps[variant])
        out[f"{variant}_rounds_s"] = steps[variant]
    out["view_over_copy"] = out["view_step_s"] / out["copy_step_s"]
    out["view_over_head"] = out["view_step_s"] / out["head_step_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", default=["8@512", "8@2048"], help="n@P: n sampled rows of a P-token prompt")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new", type=int, default=8, help="new tokens a row")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "token_major_reads.json")
    args = p.parse_args()
    from hf_vkv.ab.harness import describe_environment
    from hf_vkv.default_model import load_default_model

    model, _ = load_default_model()
    report: dict[str, Any] = dict(benchmark="token_major_reads", command=" ".join([sys.executable, *sys.argv]),
                                  environment=describe_environment(model), cells=[])
    for threads in args.threads:
        torch.set_num_threads(threads)
        for cell in args.cells:
            rows, prompt = (int(x) for x in cell.split("@"))
            result = {"threads": threads, **_cell(model, rows, prompt, new=args.new, rounds=args.rounds)}
            report["cells"].append(result)
            print(f"{cell} {threads} thread(s): step copy {1e3 * result['copy_step_s']:.1f} ms, view "
                  f"{1e3 * result['view_step_s']:.1f} ms ({result['view_over_copy']:.2f}x), head-major "
                  f"{1e3 * result['head_step_s']:.1f} ms; identical {result['identical']}", flush=True)
    write_report(args.json, report)
    return 0 if all(c["identical"] for c in report["cells"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

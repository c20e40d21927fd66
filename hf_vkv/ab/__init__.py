"""A/B against DynamicCache: the same ``generate()`` with both caches, compared step by step.

    from hf_vkv.ab import run_ab, format_report
    report = run_ab(model, inputs, max_new_tokens=32, num_beams=4)
    print(format_report(report))          # per step: tokens, K/V, max |logit diff|, KV bytes, time
    assert report.identical, report.first_divergence
    report.write_json("ab.json")          # schema: hf_vkv.ab.schema.AB_REPORT_SCHEMA

Modules: :mod:`.harness` (``run_ab``), :mod:`.probes` (what is attached to each run),
:mod:`.records` (the report), :mod:`.schema` (its JSON schema), :mod:`.table`, :mod:`.plot`,
:mod:`.bench` (the benchmark of ``hf-vkv bench`` and ``benchmarks/generate_cpu.py``, with
:mod:`.bench_args`, its command line), :mod:`.shared_prompt` (TTFT and decode step of workloads
sharing a prompt, ``hf-vkv bench --shared-prompt``), :mod:`.decode` (decode-step timing of several caches,
interleaved), :mod:`.ideal` (the ideal cache it compares the layouts with), :mod:`.demo`
(``hf-vkv demo``), :mod:`.progress` (progress output).
"""

from .harness import PAGED_ATTENTION, paged_attention_available, run_ab
from .plot import plot_report
from .records import SCHEMA_VERSION, ABReport, AttentionPath, Divergence, Reference, RunSummary, StepReport
from .schema import AB_REPORT_SCHEMA
from .table import format_report, format_savings, format_summary

__all__ = [
    "AB_REPORT_SCHEMA", "ABReport", "AttentionPath", "Divergence", "PAGED_ATTENTION", "Reference",
    "RunSummary", "SCHEMA_VERSION", "StepReport",
    "format_report", "format_savings", "format_summary", "paged_attention_available", "plot_report", "run_ab",
]

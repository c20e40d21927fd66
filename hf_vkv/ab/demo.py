"""``hf-vkv demo``: where vkv wins, measured against DynamicCache on the machine in front of you.

Three A/B runs (:func:`~hf_vkv.ab.run_ab`, tokens and logits compared exactly; the per-update
K/V tee is off, it would digest the whole 1k-token cache of every row at every step):

* a ~1k-token document with a question, answered with n=8 sampling (the prompt is the same in
  all 8 rows: DynamicCache stores it 8 times, vkv once);
* the same, answered with 4 beams (beams share the prompt and the pages they have in common);
* a 45-token prompt answered greedily (one row, nothing to share: the honest baseline).

Besides each report, the vkv cache of each run is kept until its ``stats()`` are read, to show
where the savings come from (pages shared, copy-on-write copies, utilization of resident pages).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .demo_text import DOCUMENT, QUESTION, SHORT_PROMPT, document_prompt
from .harness import run_ab
from .records import ABReport

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..cache import CacheStats

__all__ = ["DEMO_CASES", "DEMO_SCHEMA_VERSION", "DemoCase", "DemoRow", "demo_to_dict", "encode_prompt",
           "ideal_kv_bytes", "run_demo"]

#: Version of the JSON of ``hf-vkv demo --json``.
DEMO_SCHEMA_VERSION = "hf_vkv.demo/1"


@dataclass(frozen=True, slots=True)
class DemoCase:
    """One A/B run of the demo: a label, which prompt, and the generation mode."""

    label: str
    prompt: Literal["document", "short"]
    generate_kwargs: Mapping[str, Any] = field(default_factory=dict)


DEMO_CASES: tuple[DemoCase, ...] = (
    DemoCase("n=8 sampling, document", "document", {"do_sample": True, "num_return_sequences": 8}),
    DemoCase("4 beams, document", "document", {"do_sample": False, "num_beams": 4}),
    DemoCase("greedy, short prompt", "short", {"do_sample": False}),
)


@dataclass(frozen=True, slots=True)
class DemoRow:
    """One case's outcome: the A/B report, the vkv cache's stats after ``generate()``, and the
    ideal cache's peak KV bytes when the benchmark provides it."""

    case: DemoCase
    report: ABReport
    stats: CacheStats | None
    ideal_kv_bytes: int | None


def ideal_kv_bytes(report: ABReport) -> int | None:
    """Peak KV bytes of an ideal cache (each distinct token stored once, no page rounding) for the
    run of ``report``, or ``None`` while unknown.

    IDEAL-CACHE HOOK: the benchmark's ideal cache (``hf_vkv/ab/ideal.py``, being added to
    ``hf-vkv bench``) is the one source for this figure; switch this function to it when it lands
    (the demo's ``vkv/ideal`` column and JSON field read only this). Until then: ``None``.
    """
    return None


class _KeepingFactory:
    """Makes a ``vkv_cache_factory`` (a :class:`~hf_vkv.VKVCache` subclass whose ``for_generate``
    keeps the cache it builds), so the cache's ``stats()`` can be read after ``generate()``."""

    def __init__(self) -> None:
        from ..cache import VKVCache

        kept: list[Any] = []

        class Keeping(VKVCache):
            @classmethod
            def for_generate(cls, *args: Any, **kwargs: Any) -> Any:
                cache = super().for_generate(*args, **kwargs)
                kept.append(cache)
                return cache

        self.cache_class = Keeping
        self._kept = kept

    def take_stats(self) -> CacheStats | None:
        """The kept cache's stats; the cache is closed and dropped (its pages go back)."""
        if not self._kept:
            return None
        cache = self._kept.pop()
        self._kept.clear()
        stats = cache.stats()
        cache.close()
        return stats


def encode_prompt(tok: PreTrainedTokenizerBase, text: str) -> dict[str, Any]:
    """``input_ids`` / ``attention_mask`` ``[1, n]`` of ``text`` as one user message (chat template)."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return dict(tok([text], return_tensors="pt"))


def _document(tok: PreTrainedTokenizerBase, max_tokens: int | None) -> str:
    """The document prompt, cut to its first ``max_tokens`` tokens when given (the question kept)."""
    if max_tokens is None:
        return document_prompt()
    ids = tok(DOCUMENT, add_special_tokens=False)["input_ids"][:max_tokens]
    return f"{tok.decode(ids)}\n{QUESTION}"


def run_demo(model: PreTrainedModel, tok: PreTrainedTokenizerBase, *, max_new_tokens: int,
             cases: Sequence[DemoCase] = DEMO_CASES, document_tokens: int | None = None, seed: int = 0,
             progress: bool = True, on_start: Callable[[DemoCase, int], None] | None = None) -> list[DemoRow]:
    """Run every case as an A/B against DynamicCache; return one :class:`DemoRow` each.

    Args:
        model, tok: a causal LM on the CPU or a CUDA device, and its tokenizer.
        max_new_tokens: tokens generated per row in every case.
        cases: what to run (default :data:`DEMO_CASES`).
        document_tokens: cut the document to this many tokens (tests; default: all of it).
        seed: the seed of both runs of each case.
        progress: per-run progress on stderr (see :mod:`hf_vkv.ab.progress`).
        on_start: called as ``on_start(case, prompt_tokens)`` before each case.
    """
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    device = next(model.parameters()).device
    texts = {"document": _document(tok, document_tokens), "short": SHORT_PROMPT}
    rows = []
    for case in cases:
        inputs = {k: v.to(device) for k, v in encode_prompt(tok, texts[case.prompt]).items()}
        if on_start is not None:
            on_start(case, int(inputs["input_ids"].shape[1]))
        keep = _KeepingFactory()
        report = run_ab(model, inputs, max_new_tokens=max_new_tokens, tee=False, seed=seed, progress=progress,
                        vkv_cache_factory=keep.cache_class, pad_token_id=pad, **case.generate_kwargs)
        rows.append(DemoRow(case=case, report=report, stats=keep.take_stats(), ideal_kv_bytes=ideal_kv_bytes(report)))
    return rows


def _stats_dict(stats: CacheStats | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {"resident_bytes": stats.resident_bytes, "token_bytes": stats.token_bytes,
            "utilization": stats.utilization, "shared_pages": stats.shared_pages, "cow_copies": stats.cow_copies,
            "shared_prompt_rows": sum(g.shared_prompt_rows for g in stats.groups),
            "prompt_tokens_computed": stats.prompt_tokens_computed, "prompt_tokens_saved": stats.prompt_tokens_saved,
            "prefill_once": stats.prefill_once}


def demo_to_dict(rows: Sequence[DemoRow], *, wall_s: float, environment: Mapping[str, str]) -> dict[str, Any]:
    """The JSON object of ``hf-vkv demo --json`` (schema :data:`DEMO_SCHEMA_VERSION`)."""
    out = []
    for row in rows:
        r = row.report
        d, v = r.dynamic, r.vkv
        out.append({
            "label": row.case.label, "mode": r.mode, "prompt_tokens": r.prompt_tokens, "rows": r.rows,
            "steps": v.steps, "identical": r.identical, "tokens_identical": r.tokens_identical,
            "first_divergence": r.first_divergence.describe() if r.first_divergence else None,
            "kv_peak_bytes": {"dynamic": d.kv_peak_bytes, "vkv": v.kv_peak_bytes, "ideal": row.ideal_kv_bytes},
            "kv_ratio_vs_dynamic": v.kv_peak_bytes / d.kv_peak_bytes if d.kv_peak_bytes else None,
            "decode_step_s": {"dynamic": d.decode_step_s, "vkv": v.decode_step_s},
            "prefill_s": {"dynamic": d.prefill_s, "vkv": v.prefill_s},
            # time to first token = step 0 (set-up, prefill, first logits), beside KV memory
            "ttft_s": {"dynamic": d.prefill_s, "vkv": v.prefill_s},
            "ttft_ratio_vs_dynamic": v.prefill_s / d.prefill_s if d.prefill_s else None,
            "decode_ratio_vs_dynamic": (v.decode_step_s / d.decode_step_s
                                        if d.decode_step_s and v.decode_step_s else None),
            "vkv_stats": _stats_dict(row.stats),
        })
    return {"schema": DEMO_SCHEMA_VERSION, "identical": all(r.report.identical for r in rows), "wall_s": wall_s,
            "environment": dict(environment), "runs": out}

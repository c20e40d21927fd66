"""The records an A/B run produces: per step, per run, the first divergence, the whole report.

Every record is a frozen slots dataclass of plain Python values (no tensors), so a report can be
kept, compared and written as JSON (:meth:`ABReport.to_json`, schema in :mod:`hf_vkv.ab.schema`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["CASCADE_FP32_LOGIT_BOUND", "CASCADE_LOGIT_BOUNDS", "SCHEMA_VERSION", "ABReport", "AttentionPath", "Divergence", "DivergenceKind", "Reference", "RunSummary", "StepReport"]

#: Version of the JSON written by :meth:`ABReport.to_json`; bumped on any incompatible change.
SCHEMA_VERSION = "hf_vkv.ab/1"

#: What differed first: a layer's K/V (tee), a row's logits, a row's chosen token, or the number of
#: steps (one run stopped earlier).
DivergenceKind = Literal["kv", "logits", "tokens", "steps"]

#: Where the vkv run's attention reads K/V from (``run_ab(layout=...)``, ``hf-vkv ab --layout``, the
#: report's ``layout`` field): ``"contiguous"``, the ``[B, H, T, D]`` tensors ``update`` returns, read
#: by the model's own attention; ``"paged"``, the pages themselves, through block tables, read by
#: the ``"vkv_paged"`` attention; ``"cascade"``, the returned tensors read by the ``"vkv_cascade"``
#: attention, which reads a prefix shared by several rows once (it reorders float sums, so its
#: verdict is :attr:`ABReport.tokens_identical` with :attr:`ABReport.max_abs_logit_diff`). Not a
#: cache layout (those are :class:`hf_vkv.cache.layouts.Layout`).
AttentionPath = Literal["contiguous", "paged", "cascade"]
#: What the DynamicCache run of an A/B with a prefix store is (``run_ab(reference=...)``,
#: ``hf-vkv ab --reuse N --reference``, the report's ``reference`` field): ``"continued"``, a
#: DynamicCache holding the history the vkv run took from the store, continued over the rest of
#: the prompt (the same computation: the verdict is exact); ``"prefill"``, DynamicCache prefilling
#: the whole prompt (a different float sum: identical tokens, max |Δlogit| reported).
Reference = Literal["continued", "prefill"]
#: Largest |Δlogit| the cascade path may show against DynamicCache, per dtype of the model (the
#: dtype in the report's environment). float32: what ``tests/integration/test_cascade.py`` asserts
#: on the tiny models (measured there up to 2.9e-6; SmolLM2 at 8192 tokens reached 1.125e-4, over
#: it). Half precision (served only with ``cache_config={"cascade_half_precision": True}``): one
#: rounding step of a logit of magnitude ~8-16 in the dtype, the most measured before tokens part
#: (``benchmarks/results/cascade_half_precision.json``). A dtype not listed has no bound: its
#: cascade runs never pass.
CASCADE_LOGIT_BOUNDS: dict[str, float] = {"float32": 1e-4, "float16": 2 ** -7, "bfloat16": 2 ** -4}
CASCADE_FP32_LOGIT_BOUND = CASCADE_LOGIT_BOUNDS["float32"]


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first place where the vkv run differs from the DynamicCache run.

    Within a step the order is the order of computation: K/V of layer 0..L-1 (keys before values),
    then logits, then the chosen tokens. ``row`` indexes the running rows of that step
    (``batch x max(num_beams, num_return_sequences)`` of them); at the last step of beam search,
    ``kind="tokens"`` indexes the returned sequences instead.
    """

    step: int  # 0 is the prefill
    kind: DivergenceKind
    layer: int | None  # set for kind "kv"
    row: int | None  # None for kind "steps"
    tensor: Literal["keys", "values"] | None  # set for kind "kv"
    detail: str  # one human-readable sentence

    def describe(self) -> str:
        """``"step 3, layer 1, row 0 (keys): ..."``."""
        where = [f"step {self.step}"]
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        if self.row is not None:
            where.append(f"row {self.row}")
        what = f" ({self.tensor})" if self.tensor else ""
        return f"{', '.join(where)}{what}: {self.detail}"


@dataclass(frozen=True, slots=True)
class StepReport:
    """One generation step (a forward and the choice of the next tokens) of both runs.

    A field is ``None`` where it cannot be compared: the step exists in one run only, or the tee
    was off (``kv_equal``).
    """

    step: int  # 0 is the prefill
    tokens_equal: bool | None  # the tokens chosen at this step, all rows
    rows_differing: tuple[int, ...]  # rows whose token or logits differ
    max_abs_logit_diff: float | None  # max over rows and vocabulary of |logit_vkv - logit_dynamic|
    kv_equal: bool | None  # every layer's K/V equal, every row (tee mode)
    layers_differing: tuple[int, ...]  # layers whose K or V differ in some row (tee mode)
    kv_bytes_dynamic: int | None  # DynamicCache: bytes of its layers' key/value tensors
    kv_bytes_vkv: int | None  # VKVCache: resident bytes of its pages
    time_dynamic_s: float | None  # wall time of the step, the harness's own bookkeeping excluded
    time_vkv_s: float | None
    # beam search: rows are beams, and each run orders (and may choose) its beams itself, so the
    # logits are compared beam by beam: row i of vkv with the DynamicCache row of the same token
    # history (``max_abs_logit_diff`` is over those pairs). This counts the vkv rows whose history
    # the DynamicCache run did not hold at this step (a near-tie put another candidate in a beam;
    # their logits are not comparable). None outside beam search.
    beams_unmatched: int | None = None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run (one cache) as a whole."""

    cache: Literal["dynamic", "vkv"]
    steps: int
    wall_s: float  # the whole generate() call, bookkeeping included
    prefill_s: float  # step 0 (generate's set-up, prefill, first token)
    decode_step_s: float | None  # mean time of steps 1.. (None with a single step)
    kv_peak_bytes: int  # the most over the steps and at the end
    kv_final_bytes: int  # after generate() returned


@dataclass(frozen=True, slots=True)
class ABReport:
    """The outcome of :func:`hf_vkv.ab.run_ab`: the same ``generate()`` with DynamicCache and vkv.

    ``identical`` is the verdict: same tokens, same logits, and (tee mode) the same K/V at every
    step, layer and row. Otherwise ``first_divergence`` says where it started.
    """

    model: str
    layout: AttentionPath  # the attention path of the vkv run (the JSON key predates the name)
    mode: Literal["greedy", "sample", "beam"]
    tee: bool
    seed: int
    generate_kwargs: dict[str, Any]  # JSON-able generation arguments of both runs
    prompt_tokens: int  # input length (padding included)
    batch: int
    rows: int  # batch x max(num_beams, num_return_sequences)
    tokens_identical: bool  # the returned sequences are equal
    first_divergence: Divergence | None
    dynamic: RunSummary
    vkv: RunSummary
    steps: tuple[StepReport, ...]
    generated_dynamic: tuple[tuple[int, ...], ...]  # returned sequences, prompt removed
    generated_vkv: tuple[tuple[int, ...], ...]
    environment: dict[str, str] = field(default_factory=dict)  # versions and device
    prefix_reuse: dict[str, Any] | None = None  # the vkv run started from a prefix store: what it reused
    reference: Reference | None = None  # with a prefix store: what the DynamicCache run was (None: no store)

    @property
    def identical(self) -> bool:
        """Tokens, logits and (tee mode) K/V identical everywhere."""
        return self.tokens_identical and self.first_divergence is None

    @property
    def max_abs_logit_diff(self) -> float:
        """The largest |logit_vkv - logit_dynamic| over every step both runs made (0.0 when equal)."""
        return max((s.max_abs_logit_diff for s in self.steps if s.max_abs_logit_diff is not None), default=0.0)

    @property
    def logit_bound(self) -> float | None:
        """The cascade path's |Δlogit| bound for this run's dtype (:data:`CASCADE_LOGIT_BOUNDS`);
        ``None`` for another path (which must be identical) or a dtype with no bound."""
        if self.layout != "cascade":
            return None
        return CASCADE_LOGIT_BOUNDS.get(self.environment.get("dtype", ""))

    @property
    def within_bound(self) -> bool:
        """The cascade's max |Δlogit| is at most its dtype's bound (False with no bound)."""
        bound = self.logit_bound
        return bound is not None and self.max_abs_logit_diff <= bound

    @property
    def passed(self) -> bool:
        """The oracle's verdict for this attention path: :attr:`identical`; for ``"cascade"``
        (float sums reordered on purpose) identical tokens and logits within the dtype's bound
        (:attr:`within_bound`): a run over its bound does not pass. With a prefix store
        (``prefix_reuse``) compared with a continued DynamicCache (``reference="continued"``: the
        same history, the same new tokens computed) the verdict is :attr:`identical` too; compared
        with DynamicCache's whole prefill (``reference="prefill"``: only the new tokens prefilled
        over stored K/V is a different sum) it is identical tokens, max |Δlogit| reported."""
        if self.prefix_reuse is not None and self.reference != "continued":
            return self.tokens_identical
        if self.layout != "cascade":
            return self.identical
        return self.tokens_identical and self.within_bound

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of :data:`~hf_vkv.ab.schema.AB_REPORT_SCHEMA` (``schema`` key first)."""
        body = asdict(self)
        body["identical"] = self.identical
        for key in ("steps", "generated_dynamic", "generated_vkv"):
            body[key] = [list(x) if isinstance(x, tuple) else x for x in body[key]]
        for step in body["steps"]:
            step["rows_differing"] = list(step["rows_differing"])
            step["layers_differing"] = list(step["layers_differing"])
            diff = step["max_abs_logit_diff"]
            if diff is not None and not math.isfinite(diff):  # JSON has no inf/nan
                step["max_abs_logit_diff"] = "nan" if math.isnan(diff) else "inf"
        return {"schema": SCHEMA_VERSION, **body}

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON text (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def write_json(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` (parent folders created); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

"""The JSON schema of an A/B report (``hf-vkv ab --json``, :meth:`ABReport.to_json`).

Version ``hf_vkv.ab/1``. A JSON Schema (draft 2020-12) document, so any validator can check a
report; every object is closed (``additionalProperties: false``), so a field added to the records
without a schema change fails the tests. Units: bytes, seconds; steps count from 0 (the prefill).

Top level:

=====================  ==========================================================================
``schema``             ``"hf_vkv.ab/1"``
``identical``          verdict: tokens, logits and (with ``tee``) K/V equal at every step
``tokens_identical``   the returned sequences are equal
``first_divergence``   ``null`` or {step, kind (kv|logits|tokens|steps), layer, row, tensor, detail}
``steps``              one object per step: tokens_equal, rows_differing, max_abs_logit_diff,
                       kv_equal, layers_differing, kv_bytes_dynamic/_vkv, time_dynamic_s/_vkv,
                       beams_unmatched (beam search: logits compared beam by beam, matched by
                       token history; vkv beams with no match at that step; else null)
``dynamic``, ``vkv``   per run: steps, wall_s, prefill_s, decode_step_s, kv_peak_bytes,
                       kv_final_bytes
``generated_*``        the returned sequences' new tokens, one list per sequence
``prefix_reuse``       ``null``, or what prefix reuse did in the vkv run (a prefix store given:
                       reused_tokens, computed_tokens, start_column, ...)
``reference``          ``null`` (no prefix store), ``"continued"`` (the DynamicCache run continued
                       a DynamicCache holding the history the vkv run took from the store: the
                       verdict is exact) or ``"prefill"`` (it prefilled the whole prompt: the
                       verdict is the tokens, with max |Δlogit| in ``steps``)
other fields           model, layout, mode, tee, seed, generate_kwargs, prompt_tokens, batch,
                       rows, environment (versions, device)
=====================  ==========================================================================

``max_abs_logit_diff`` is a number, ``null`` (the step exists in one run only) or the string
``"inf"`` / ``"nan"`` (shapes differ / one side is NaN), as JSON has no such numbers.
"""

from __future__ import annotations

from typing import Any, get_args

from .records import SCHEMA_VERSION, AttentionPath, Reference

__all__ = ["AB_REPORT_SCHEMA", "SCHEMA_VERSION"]

_INT = {"type": "integer", "minimum": 0}
_OPT_INT = {"type": ["integer", "null"], "minimum": 0}
_OPT_SECONDS = {"type": ["number", "null"]}
_ROWS = {"type": "array", "items": _INT}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


_DIVERGENCE = _object({
    "step": _INT,
    "kind": {"enum": ["kv", "logits", "tokens", "steps"]},
    "layer": _OPT_INT,
    "row": _OPT_INT,
    "tensor": {"enum": ["keys", "values", None]},
    "detail": {"type": "string"},
})

_STEP = _object({
    "step": _INT,
    "tokens_equal": {"type": ["boolean", "null"]},
    "rows_differing": _ROWS,
    "max_abs_logit_diff": {"oneOf": [{"type": "number", "minimum": 0}, {"type": "null"}, {"enum": ["inf", "nan"]}]},
    "kv_equal": {"type": ["boolean", "null"]},
    "layers_differing": _ROWS,
    "kv_bytes_dynamic": _OPT_INT,
    "kv_bytes_vkv": _OPT_INT,
    "time_dynamic_s": _OPT_SECONDS,
    "time_vkv_s": _OPT_SECONDS,
    "beams_unmatched": _OPT_INT,
})


def _run(cache: str) -> dict[str, Any]:
    return _object({
        "cache": {"const": cache},
        "steps": _INT,
        "wall_s": {"type": "number", "minimum": 0},
        "prefill_s": {"type": "number"},
        "decode_step_s": _OPT_SECONDS,
        "kv_peak_bytes": _INT,
        "kv_final_bytes": _INT,
    })


_SEQUENCES = {"type": "array", "items": _ROWS}

#: JSON Schema of :meth:`hf_vkv.ab.ABReport.to_dict` (and of ``hf-vkv ab --json``).
AB_REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "hf_vkv A/B report against DynamicCache",
    **_object({
        "schema": {"const": SCHEMA_VERSION},
        "identical": {"type": "boolean"},
        "model": {"type": "string"},
        "layout": {"enum": list(get_args(AttentionPath))},  # the vkv run's attention path
        "mode": {"enum": ["greedy", "sample", "beam"]},
        "tee": {"type": "boolean"},
        "seed": {"type": "integer"},
        "generate_kwargs": {"type": "object", "additionalProperties": {"type": ["boolean", "integer", "number",
                                                                                "string", "null"]}},
        "prompt_tokens": _INT,
        "batch": _INT,
        "rows": _INT,
        "tokens_identical": {"type": "boolean"},
        "first_divergence": {"oneOf": [{"type": "null"}, _DIVERGENCE]},
        "dynamic": _run("dynamic"),
        "vkv": _run("vkv"),
        "steps": {"type": "array", "items": _STEP},
        "generated_dynamic": _SEQUENCES,
        "generated_vkv": _SEQUENCES,
        "environment": {"type": "object", "additionalProperties": {"type": "string"}},
        "prefix_reuse": {"oneOf": [{"type": "null"}, {"type": "object", "additionalProperties": {
            "type": ["integer", "number", "string", "null"]}}]},
        "reference": {"enum": [*get_args(Reference), None]},
    }),
}

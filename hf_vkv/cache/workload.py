"""The layout of a ``generate()`` call when ``cache_config`` names none: the device's default,
except where a measured workload says otherwise.

Head-major (the CPU default) keeps a partly written tail page per (layer, K/V, head) of a row, so
when beams diverge after a reorder each beam copies one page per sub-row (SmolLM2: 180 per beam
per step); token-major copies one page per row. With short prompts that copying is a visible part
of the step. Measured (``python benchmarks/beam_layout_cpu.py``, SmolLM2-135M fp32, 4 beams, 16
new tokens, one thread, median of interleaved rounds, tokens identical to DynamicCache):

=============  ==========  ==========  ===========
prompt         DynamicCache head-major  token-major
=============  ==========  ==========  ===========
45 (4 rounds)  1.41 s      1.89 s      1.43 s
512 (3)        6.30 s      6.86 s      6.19 s
=============  ==========  ==========  ===========

so CPU beam search with prompts up to :data:`hf_vkv.devices.BEAM_TOKEN_MAJOR_MAX_PROMPT` tokens gets
token-major. Since beam reorders copy a taken tail into the row's own page instead of remapping
and copying it on write (:meth:`hf_vkv.memory.RowBuffer.reorder`), head-major no longer pays per
sub-row at short prompts, and the two layouts' decode steps are within the run-to-run spread
(``python benchmarks/beam_layout_cpu.py --prompt-tokens P --new-tokens 12 --rounds 3``, median
decode step against DynamicCache's in the same runs: 64 tokens head-major 1.060x, token-major
1.065x; 512 tokens 0.970x and 0.968x; ``benchmarks/results/beam_layout_cpu_step_{64,512}.json``),
so the rule stands on the wall times above. Longer prompts keep head-major: its decode steps read per-head rows, and at ~1k
tokens the demo's 4-beam run is faster than DynamicCache with it (README); where exactly the
two cross between 512 and ~1k tokens is not measured.
"""

from __future__ import annotations

from .. import devices

__all__ = ["layout_for_generate"]


def layout_for_generate(*, device_type: str, num_beams: int, prompt_tokens: int | None) -> str | None:
    """The layout for a ``generate()`` call on ``device_type`` (``None``: the device's default)."""
    if device_type == "cpu" and num_beams > 1 and prompt_tokens is not None \
            and prompt_tokens <= devices.BEAM_TOKEN_MAJOR_MAX_PROMPT:
        return "token_major"
    return None

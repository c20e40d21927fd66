"""The weights fingerprint samples every parameter within its bounds, however large it is.

SmolLM2's embedding has 28,311,552 values: evenly spaced indices computed with a float32
``torch.linspace`` rounded the last one up to 28,311,552, past the end (``IndexError`` in
``save_prefix(..., model=model)`` and ``PrefixStore.save(..., model=model)``).
"""

from __future__ import annotations

import torch

from hf_vkv.prefix.fingerprint import weights_fingerprint

SMOLLM2_EMBEDDING = 49152 * 576  # 28,311,552 values: past float32's 2**24 exact integers


def _model(numel: int) -> torch.nn.Module:
    module = torch.nn.Module()
    # int8 keeps the tensor at 28 MB; the fingerprint samples any dtype as float32
    module.weight = torch.nn.Parameter(torch.zeros(numel, dtype=torch.int8), requires_grad=False)
    return module


def test_a_parameter_past_float32_exact_integers_is_fingerprinted() -> None:
    assert torch.linspace(0, SMOLLM2_EMBEDDING - 1, 256)[-1].long() >= SMOLLM2_EMBEDDING  # the old bug's cause
    model = _model(SMOLLM2_EMBEDDING)
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    with torch.no_grad():
        model.weight[-1] = 1  # the last value is sampled
    assert weights_fingerprint(model) != before


def test_small_parameters_are_sampled_whole() -> None:
    for numel in (1, 2, 255, 256, 257):
        model = _model(numel)
        before = weights_fingerprint(model)
        with torch.no_grad():
            model.weight[-1] = 3
        assert weights_fingerprint(model) != before, numel

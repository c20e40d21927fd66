"""A decode step's path through the cache stays shallow: at most 4 Python calls of ``hf_vkv``
below ``VKVLayer.update`` (layer -> group -> layout or row buffer -> translator or page table).

Measured with ``sys.setprofile`` during one one-token decode step of a tiny Llama (after a
prefill), for the default CPU layout and for token-major: every ``hf_vkv`` frame entered below an
``update`` frame of a :class:`~hf_vkv.cache.layer.VKVLayer` counts the ``hf_vkv`` frames between
them (frames of torch or of ``<string>``-made dataclass methods do not count). The step stays
inside the rows' last pages (the common case; a step that takes a page goes through the
page-table transaction, which is deeper).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from models import tiny

import hf_vkv
from hf_vkv import VKVCache
from hf_vkv.cache.layer import VKVLayer

PACKAGE = os.path.dirname(hf_vkv.__file__) + os.sep
MAX_DEPTH = 4


def _deepest_path(layout: str | None) -> tuple[str, int, list[str], int]:
    """(the cache's layout, the deepest ``hf_vkv`` depth below ``VKVLayer.update``, that path,
    ``update`` calls seen) over one decode step."""
    model = tiny("llama")
    cache = VKVCache(model.config, **({} if layout is None else {"layout": layout}))
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    update = VKVLayer.update.__code__
    deepest: list = [0, []]
    updates = [0]

    def profile(frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        if frame.f_code is update:
            updates[0] += 1
            return
        path, f = [], frame
        while f is not None and f.f_code is not update:
            if f.f_code.co_filename.startswith(PACKAGE):
                path.append(f"{os.path.relpath(f.f_code.co_filename, PACKAGE)}:{f.f_code.co_name}")
            f = f.f_back
        if f is not None and len(path) > deepest[0]:
            deepest[:] = [len(path), path[::-1]]

    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        step = logits[:, -1:].argmax(-1)
        pages = cache.stats().resident_bytes
        sys.setprofile(profile)
        try:
            model(input_ids=step, past_key_values=cache, use_cache=True)
        finally:
            sys.setprofile(None)
    assert cache.get_seq_length() == 10
    assert cache.stats().resident_bytes == pages, "the step took a page: not the step this test measures"
    return str(cache.layout), deepest[0], deepest[1], updates[0]


@pytest.mark.parametrize("layout", [None, "token_major"], ids=["cpu-default", "token_major"])
def test_a_decode_step_is_at_most_four_calls_deep_below_update(layout: str | None) -> None:
    name, depth, path, updates = _deepest_path(layout)
    assert updates == tiny("llama").config.num_hidden_layers  # every layer's update was seen
    assert name == (layout or name) and depth >= 2, (name, depth, path)  # it reached the group and below
    assert depth <= MAX_DEPTH, f"{name}: {depth} hf_vkv calls deep below VKVLayer.update: {' -> '.join(path)}"

"""Prefix reuse on CUDA pages: a chat whose every turn takes its stored entry over
(:meth:`PrefixStore.take`, :meth:`VKVCache.take_over`: the entry's device reservation moves into the
turn's cache), token- and logit-identical to the DynamicCache that holds the same history,
continued (the contract of ``tests/integration/test_reuse_contract.py``), under deterministic kernels.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import GPU
from models import _seeded
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_vkv import PrefixStore, reuse_report
from hf_vkv.ab.deterministic import deterministic_kernels
from hf_vkv.generate import cache_kwarg

pytestmark = [*GPU, pytest.mark.integration]


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    """8 KiB of K/V per token in 16-bit (4 layers x K,V x 8 heads x 64): 256 tokens a 2 MiB page."""
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    return _seeded(3, lambda: LlamaForCausalLM(cfg)).to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_chat_takes_each_entry_over_and_equals_the_continued_dynamic_cache(dtype: torch.dtype) -> None:
    model = _model(dtype)
    store = PrefixStore(model.config)
    taken: list[int] = []
    take = store.take
    store.take = lambda ids, *, into: taken.append(take(ids, into=into)) or taken[-1]  # counts the take-overs
    g = torch.Generator().manual_seed(7)
    history = torch.randint(3, 512, (1, 240), generator=g)  # the first answer crosses a page
    ref_cache: DynamicCache | None = None
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=0)
    with deterministic_kernels("cuda"):
        for turn in range(4):
            history = torch.cat([history, torch.randint(3, 512, (1, 5 + turn), generator=g)], dim=1)
            ids = history.to("cuda")
            lent = store.longest_prefix(history[0].tolist())
            if ref_cache is not None:
                assert lent == ref_cache.get_seq_length()
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(): ref_cache}, **kwargs)
            got = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="vkv",
                                 cache_config={"prefix_store": store}, **kwargs)
            assert torch.equal(ref.sequences, got.sequences), f"turn {turn + 1}: tokens differ"
            assert all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits, strict=True)), f"turn {turn + 1}"
            report = reuse_report(got)
            assert report.refusal is None and report.reused_tokens == lent
            assert taken[-1] == (lent if turn else 0)  # from turn 2 on, the entry moved into the call
            assert got.past_key_values.layers[0].keys.device.type == "cuda"
            store.check_invariants()
            got.past_key_values.check_invariants()
            ref_cache = ref.past_key_values
            history = got.sequences.cpu()
    assert [len(p) for p in store.prefixes()] == [history.shape[1] - 1]


def test_take_over_moves_a_device_row_without_a_copy() -> None:
    model = _model(torch.float16)
    store = PrefixStore(model.config)
    ids = torch.randint(3, 512, (1, 300), generator=torch.Generator().manual_seed(8)).cuda()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                         cache_implementation="vkv", cache_config={"prefix_store": store}, pad_token_id=0)
    (entry,) = store.prefixes()
    keys = store.lookup(out[0].tolist()).layers[0].keys.clone()
    into = store.new_cache(device="cuda")
    assert store.take(list(entry) + [5], into=into) == len(entry)
    assert store.prefixes() == [] and into.get_seq_length() == len(entry)
    assert torch.equal(into.layers[0].keys, keys)
    into.check_invariants()
    store.check_invariants()

"""Token identity with DynamicCache through ``generate()`` on the GPU.

The tiny random models of ``tests/models.py`` (five architectures), a wider llama and a llama of
SmolLM2-135M's K/V shape (30 layers x 3 KV heads x 64: ~91 tokens per 2 MiB page in the token-major
layout) whose rows cross several pages (beams reorder and copy-on-write across page boundaries,
``num_return_sequences`` forks share the prompt's pages) run on CUDA in float16 and bfloat16, with ``sdpa`` and ``eager``
attention, greedy / beam search / sampling with ``num_return_sequences > 1``. Outputs must be
``torch.equal`` to the DynamicCache run with the same seed; the cache must live in CUDA pages.
"""

from __future__ import annotations

import copy
import functools
import gc

import pytest
import torch
from gpu_helpers import GPU
from models import ARCHS, _seeded, assert_same_tokens, generate_both, prompts, tiny
from transformers import LlamaConfig, LlamaForCausalLM

from hf_vkv import VKVCache
from hf_vkv.ab.deterministic import deterministic_kernels

pytestmark = [*GPU, pytest.mark.integration]


@pytest.fixture(autouse=True)
def _deterministic_kernels():
    """The reference must repeat itself: cuDNN attention (torch's default on an H100) does not."""
    with deterministic_kernels("cuda"):
        yield

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODES = {
    "greedy": dict(do_sample=False),
    "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, num_return_sequences=3, top_k=0, temperature=1.5),
}


@functools.cache
def _on_gpu(arch: str, attn: str, dtype_name: str) -> torch.nn.Module:
    return copy.deepcopy(tiny(arch, attn=attn)).to("cuda", DTYPES[dtype_name])  # tiny()'s model stays on the CPU


@functools.cache
def _wide(attn: str, dtype_name: str) -> torch.nn.Module:
    """A llama with 8 KiB of K/V per token in fp16/bf16 (4 layers x K,V x 8 heads x 64): 256
    tokens per 2 MiB page, so these generations cross page boundaries."""
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    cfg._attn_implementation = attn
    return _seeded(3, lambda: LlamaForCausalLM(cfg)).to("cuda", DTYPES[dtype_name])


@functools.cache
def _smollm2_shape(attn: str, dtype_name: str) -> torch.nn.Module:
    """SmolLM2-135M's layers, heads and head size (its K/V bytes per token), a small vocabulary."""
    cfg = LlamaConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    cfg._attn_implementation = attn
    return _seeded(4, lambda: LlamaForCausalLM(cfg)).to("cuda", DTYPES[dtype_name])


def _cuda(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("cuda") for k, v in inputs.items()}


def _check_cache(cache: VKVCache) -> None:
    from hf_vkv.cuda import CudaBackend

    assert isinstance(cache, VKVCache)
    cache.check_invariants()
    buffers = [g.buffer for g in cache.groups if g.buffer is not None]
    assert buffers and all(isinstance(b.store.backend, CudaBackend) for b in buffers)


def _run(model, inputs, mode: str, new: int) -> None:
    ref, got = generate_both(model, inputs, seed=11, max_new_tokens=new, **MODES[mode])
    assert_same_tokens(ref.sequences, got.sequences)
    _check_cache(got.past_key_values)
    del ref, got
    gc.collect()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models(arch: str, dtype: str, attn: str, mode: str) -> None:
    _run(_on_gpu(arch, attn, dtype), _cuda(prompts(3, 9, seed=1, left_pad=[0, 4, 7])), mode, new=20)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_crossing_pages(dtype: str, attn: str, mode: str) -> None:
    model = _wide(attn, dtype)
    inputs = _cuda(prompts(2, 200, seed=5, left_pad=[0, 30]))
    _run(model, inputs, mode, new=120)  # 200 + 120 > 256 tokens a page


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_shape_rows_cross_several_pages(dtype: str, attn: str, mode: str) -> None:
    model = _smollm2_shape(attn, dtype)
    inputs = _cuda(prompts(3, 150, seed=6, left_pad=[0, 40, 95]))
    _run(model, inputs, mode, new=130)  # 280 tokens: rows span 2-4 pages, beams swap pages mid-row


def _free_after_empty_cache() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # torch's cached blocks would hide (or fake) a leak
    return torch.cuda.mem_get_info()[0]


def test_pages_go_back_after_generate() -> None:
    model = _on_gpu("llama", "sdpa", "fp16")
    inputs = _cuda(prompts(2, 9, seed=2))
    model.generate(**inputs, max_new_tokens=2, cache_implementation="vkv")  # cuBLAS workspaces etc. exist now
    free0 = _free_after_empty_cache()
    for _ in range(3):
        out = model.generate(**inputs, max_new_tokens=10, cache_implementation="vkv", return_dict_in_generate=True)
        arenas = {id(g.buffer.store): g.buffer.store for g in out.past_key_values.groups if g.buffer is not None}
        del out
        gc.collect()
        assert arenas and all(a.closed for a in arenas.values())
    free1 = _free_after_empty_cache()
    assert free1 >= free0 - (2 << 20), (free0 - free1) / 2**20  # not one 2 MiB page kept

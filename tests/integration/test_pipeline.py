"""``pipeline("text-generation")`` with ``cache_implementation="vkv"``: every way of asking for it
reaches the VKV cache, and the text is identical to the DynamicCache pipeline's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import SMALL_PAGE, tiny, tokenizer, words
from transformers import AutoModelForCausalLM, GenerationConfig, pipeline

import hf_vkv.generate.registry as registration
from hf_vkv import VKVCache

pytestmark = pytest.mark.integration

# different lengths: a batch of 2 is left-padded
PROMPTS = [words(torch.arange(10, 19)), words(torch.arange(40, 44)), words(torch.arange(100, 113)),
           words(torch.arange(7, 9))]
GREEDY = {"max_new_tokens": 12, "do_sample": False}


class CountingCache(VKVCache):
    made: list[CountingCache] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        CountingCache.made.append(self)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> list[CountingCache]:
    """The caches the generate wrapper builds during the test."""
    CountingCache.made = []
    monkeypatch.setattr(registration, "VKVCache", CountingCache)
    return CountingCache.made


def _texts(out: list[Any]) -> list[list[str]]:
    return [[r["generated_text"] for r in (o if isinstance(o, list) else [o])] for o in out]


def _reference(model: Any, **kwargs: Any) -> list[list[str]]:
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer())
    torch.manual_seed(0)
    return _texts(pipe(PROMPTS, batch_size=2, **kwargs))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_call_kwarg(counting: list[CountingCache], arch: str) -> None:
    model = tiny(arch)
    expected = _reference(model, **GREEDY)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer())
    got = _texts(pipe(PROMPTS, batch_size=2, cache_implementation="vkv", cache_config={"page_bytes": SMALL_PAGE},
                      **GREEDY))
    assert got == expected
    assert len(counting) == 2  # one cache per batch of 2
    for cache in counting:
        assert cache.stats().groups[0].rows == 2
        cache.check_invariants()


def test_init_kwarg(counting: list[CountingCache]) -> None:
    model = tiny("qwen2")
    expected = _reference(model, **GREEDY)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer(), cache_implementation="vkv")
    assert _texts(pipe(PROMPTS, batch_size=2, **GREEDY)) == expected
    assert len(counting) == 2
    # the pipeline object is reusable: a fresh cache per call
    assert _texts(pipe(PROMPTS[:2], batch_size=2, **GREEDY)) == expected[:2]
    assert len(counting) == 3


def test_generation_config(counting: list[CountingCache]) -> None:
    model = tiny("mistral")
    expected = _reference(model, **GREEDY)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer())
    config = GenerationConfig(cache_implementation="vkv", pad_token_id=0, eos_token_id=1, **GREEDY)
    assert _texts(pipe(PROMPTS, batch_size=2, generation_config=config)) == expected
    assert len(counting) == 2


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("mode", ["sample", "beam"])
def test_many_sequences_per_prompt(counting: list[CountingCache], mode: str) -> None:
    """num_return_sequences through the pipeline: the prompt's pages are stored once per prompt."""
    model = tiny("llama")
    kwargs: dict[str, Any] = {"max_new_tokens": 12, "num_return_sequences": 3}
    kwargs |= {"do_sample": True, "temperature": 1.5} if mode == "sample" else {"num_beams": 3, "do_sample": False}
    expected = _reference(model, **kwargs)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer())
    torch.manual_seed(0)
    got = _texts(pipe(PROMPTS, batch_size=2, cache_implementation="vkv", **kwargs))
    assert got == expected
    assert all(len(texts) == 3 for texts in got)
    assert sum(c.stats().groups[0].shared_prompt_rows for c in counting) == 4 * 2  # 4 prompts x 2 followers


def test_saved_generation_config_reloads(tmp_path: Any, counting: list[CountingCache]) -> None:
    """A model saved with cache_implementation="vkv" in generation_config.json reloads (hf_vkv is
    imported) and generates with the VKV cache."""
    model = tiny("llama")
    ids = tokenizer()(PROMPTS[:2], return_tensors="pt", padding=True)
    expected = model.generate(**ids, **GREEDY)
    config = GenerationConfig(**model.generation_config.to_dict())
    config.cache_implementation = "vkv"
    config.cache_config = {"page_bytes": SMALL_PAGE}
    model.save_pretrained(tmp_path)
    config.save_pretrained(tmp_path)
    assert '"vkv"' in (tmp_path / "generation_config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.generation_config.cache_implementation == "vkv"
    out = reloaded.generate(**ids, **GREEDY, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, VKVCache) and len(counting) == 1
    assert torch.equal(out.sequences, expected)
    pipe = pipeline("text-generation", model=str(tmp_path), tokenizer=tokenizer())
    assert _texts(pipe(PROMPTS, batch_size=2, **GREEDY)) == _reference(model, **GREEDY)
    assert len(counting) == 3

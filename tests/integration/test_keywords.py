"""The cache keyword of the running transformers (``cache`` from 5.24, ``past_key_values`` before).

hf_vkv reads and writes the cache under :func:`hf_vkv.generate.cache_kwarg`, refuses a user
cache passed with ``cache_implementation="vkv"`` under either name (as transformers refuses it
for its own implementations), and no deprecation warning comes from an hf_vkv frame.
"""

from __future__ import annotations

import copy
import inspect
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from transformers import CompileConfig  # noqa: F401  (the static layout below is chosen by its key)
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerationMixin

import hf_vkv
from hf_vkv.ab import run_ab
from hf_vkv.ab.decode import prefill
from hf_vkv.generate import cache_kwarg
from models import LayoutRun, prompts, tiny

pytestmark = pytest.mark.integration

HF_VKV_DIR = os.path.dirname(hf_vkv.__file__)


def test_cache_kwarg_is_the_name_generate_uses() -> None:
    params = inspect.signature(inspect.unwrap(GenerationMixin.prepare_inputs_for_generation)).parameters
    expected = "cache" if "cache" in params else "past_key_values"
    assert expected in params
    assert cache_kwarg() == expected
    out = tiny("llama").generate(**prompts(1, 5), max_new_tokens=2, cache_implementation="vkv",
                                 return_dict_in_generate=True)
    assert isinstance(out[cache_kwarg()], hf_vkv.VKVCache)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
@pytest.mark.parametrize("kind", ["dynamic", "vkv"])
def test_user_cache_with_cache_implementation_is_refused(name: str, kind: str) -> None:
    """Under either keyword: transformers' own "static" raises "Passing both ..."; so does "vkv"
    (it used to run on the user's cache and build a VKVCache it never used)."""
    model = tiny("llama")
    if name == "cache" and cache_kwarg() != "cache":
        pytest.skip("this transformers' generate() has no `cache` keyword (it is `past_key_values`)")
    user = DynamicCache(config=model.config) if kind == "dynamic" else hf_vkv.VKVCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the user's own deprecated keyword
        with pytest.raises(ValueError, match="Passing both `cache_implementation`"):
            model.generate(**prompts(1, 5), max_new_tokens=2, cache_implementation="vkv", **{name: user})
        with pytest.raises(ValueError, match="Passing both `cache_implementation`"):
            model.generate(**prompts(1, 5), max_new_tokens=2, cache_implementation="static", **{name: user})
    assert user.get_seq_length() == 0  # nothing ran


def test_continuing_a_cache_with_vkv_set_on_the_model_says_how() -> None:
    """With ``cache_implementation="vkv"`` set once on ``model.generation_config``, a call that
    continues the cache it returned was refused with transformers' "Passing both", though the call
    named only the cache. The refusal now says where the name comes from and what to add; with
    ``cache_implementation=None`` the continuation gives DynamicCache's tokens and logits."""
    model = copy.deepcopy(tiny("llama"))  # tiny's models are shared: this one's generation config is changed
    model.generation_config.cache_implementation = "vkv"
    inputs = prompts(1, 10, seed=4)
    out = model.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True)
    cache = out[cache_kwarg()]
    assert isinstance(cache, hf_vkv.VKVCache)
    ids = torch.cat([out.sequences, torch.tensor([[33, 34]])], 1)
    with pytest.raises(hf_vkv.ArgumentError, match=r"Passing both .* add cache_implementation=None to this call"):
        model.generate(input_ids=ids, **{cache_kwarg(): cache}, max_new_tokens=4)
    got = model.generate(input_ids=ids, **{cache_kwarg(): cache}, max_new_tokens=4, cache_implementation=None,
                         return_dict_in_generate=True, output_logits=True)
    reference = DynamicCache(config=model.config)
    first = model.generate(**inputs, max_new_tokens=4, cache_implementation=None, **{cache_kwarg(): reference},
                           return_dict_in_generate=True)
    assert torch.equal(first.sequences, out.sequences)
    want = model.generate(input_ids=ids, **{cache_kwarg(): reference}, max_new_tokens=4, cache_implementation=None,
                          return_dict_in_generate=True, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))


@contextmanager
def _deprecations_from_hf_vkv() -> Iterator[list[str]]:
    """Every FutureWarning / DeprecationWarning issued while an hf_vkv frame is on the stack or
    attributed to an hf_vkv file (``warnings.warn`` is wrapped to see the stack of each call)."""
    found: list[str] = []
    original = warnings.warn

    def warn(message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, **kw: Any) -> None:
        cls = category or (type(message) if isinstance(message, Warning) else UserWarning)
        if issubclass(cls, (FutureWarning, DeprecationWarning)):
            frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(HF_VKV_DIR)]
            if frames:
                found.append(f"{cls.__name__}: {message} (hf_vkv frame {frames[-1].filename}:{frames[-1].lineno})")
        original(message, category, stacklevel + 1, source, **kw)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn = warn  # type: ignore[assignment]
        try:
            yield found
        finally:
            warnings.warn = original  # type: ignore[assignment]
    found.extend(f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
                 if issubclass(w.category, (FutureWarning, DeprecationWarning)) and w.filename.startswith(HF_VKV_DIR))


def _generate(layout: str, **kwargs: Any) -> Callable[[], Any]:
    run = LayoutRun(layout)

    def go() -> Any:
        model = tiny("llama")
        with run.attention(model):
            return model.generate(**prompts(2, 6), max_new_tokens=4, cache_implementation="vkv",
                                  cache_config=run.config(), **kwargs)
    return go


CALLS: dict[str, Callable[[], Any]] = {
    "greedy head_major": _generate("head_major"),
    "beams token_major": _generate("token_major", num_beams=3),
    "sampling paged": _generate("paged", do_sample=True, num_return_sequences=2),
    "greedy static": lambda: tiny("llama").generate(**prompts(1, 6), max_new_tokens=4, cache_implementation="vkv",
                                                    cache_config={"layout": "static"}),
    "ab harness": lambda: run_ab(tiny("llama"), prompts(1, 6), max_new_tokens=3, num_beams=2),
    "bench prefill": lambda: prefill(tiny("llama"), prompts(1, 6)["input_ids"]),
    "prefix store": lambda: hf_vkv.PrefixStore(tiny("llama").config).lookup(prompts(1, 6)["input_ids"][0]),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_no_deprecation_warning_from_hf_vkv(call: str) -> None:
    if cache_kwarg() != "cache":
        pytest.skip("the check is for the newest transformers (cache keyword `cache`); older ones warn about less")
    with torch.no_grad(), _deprecations_from_hf_vkv() as found:
        CALLS[call]()
    assert not found, "\n".join(found)


def test_the_detector_sees_a_deprecated_keyword() -> None:
    """The check above is not vacuous: hf_vkv passing ``past_key_values`` on the newest
    transformers is caught."""
    if cache_kwarg() != "cache":
        pytest.skip("past_key_values is deprecated only where the keyword is `cache`")
    model = tiny("llama")
    from hf_vkv.ab import decode

    original = decode.cache_kwarg
    decode.cache_kwarg = lambda: "past_key_values"  # type: ignore[assignment]
    try:
        with torch.no_grad(), _deprecations_from_hf_vkv() as found:
            prefill(model, prompts(1, 6)["input_ids"])
    finally:
        decode.cache_kwarg = original  # type: ignore[assignment]
    assert any("past_key_values" in f for f in found), found

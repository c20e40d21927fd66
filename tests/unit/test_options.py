"""Executable specs of :class:`hf_vkv.cache.CacheOptions`: defaults, every validation message,
and the removed ``group_policy`` refused naming its replacement."""

from __future__ import annotations

import dataclasses

import pytest

from hf_vkv.cache import CacheOptions
from hf_vkv.cache.options import LAYOUT_NAMES
from hf_vkv.memory.errors import CacheOptionError, CacheOptionTypeError


def test_defaults_and_known_layout_names() -> None:
    assert CacheOptions() == CacheOptions(layout=None, groups="kind", page_bytes=None, budget_bytes=None,
                                          share_prompts=True, block_tokens=None, max_tokens=None, map_ahead=None)
    assert LAYOUT_NAMES == ("token_major", "head_major", "paged", "static", "contiguous")
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheOptions().layout = "paged"  # type: ignore[misc]
    with pytest.raises(TypeError):
        CacheOptions("paged")  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("name", ["page_bytes", "budget_bytes", "block_tokens", "max_tokens"])
@pytest.mark.parametrize("value", [0, -4096])
def test_sizes_must_be_positive_ints(name: str, value: object) -> None:
    extra = {"layout": "paged"} if name == "block_tokens" else {}
    with pytest.raises(CacheOptionError, match=rf"^cache_config\['{name}'\] must be a positive int, got {value!r}$"):
        CacheOptions(**{name: value}, **extra)
    assert getattr(CacheOptions(**{name: 1 << 16}, **extra), name) == 1 << 16  # a page size and a budget in range


@pytest.mark.parametrize("name", ["page_bytes", "budget_bytes", "block_tokens", "max_tokens", "map_ahead"])
@pytest.mark.parametrize("value", [True, 4096.0, "4096"])
def test_sizes_of_another_type_are_type_errors(name: str, value: object) -> None:
    # a wrong type is CacheOptionTypeError (a TypeError), as CacheOptionTypeError's contract says
    extra = {"layout": {"block_tokens": "paged", "map_ahead": "static"}[name]} if name in ("block_tokens", "map_ahead") else {}
    with pytest.raises(CacheOptionTypeError,
                       match=rf"^cache_config\['{name}'\] must be an int, got {type(value).__name__} {value!r}$"):
        CacheOptions(**{name: value}, **extra)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"map_ahead": -1, "layout": "static"}, ValueError, r"cache_config\['map_ahead'\] must be an int >= 0, got -1"),
    ({"map_ahead": True, "layout": "static"}, TypeError, r"must be an int, got bool True"),
    ({"map_ahead": 4}, ValueError, r"^cache_config\['map_ahead'\] applies to the static layout only$"),
    ({"layout": "ring"}, ValueError,
     r"cache_config\['layout'\] must be one of \['token_major', 'head_major', 'paged', 'static', 'contiguous'\], "
     r"got 'ring'"),
    ({"groups": "model"}, ValueError, r"^cache_config\['groups'\] must be 'kind' or 'layer', got 'model'$"),
    ({"share_prompts": 1}, TypeError, r"^cache_config\['share_prompts'\] must be a bool, got 1$"),
    ({"block_tokens": 4, "layout": "head_major"}, ValueError,
     r"^cache_config\['block_tokens'\] applies to the paged layout only, not 'head_major'$"),
])
def test_each_bad_option_is_named_in_its_error(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CacheOptions(**kwargs)


def test_valid_combinations() -> None:
    assert CacheOptions(map_ahead=0, layout="static").map_ahead == 0
    assert CacheOptions(block_tokens=8).block_tokens == 8  # no layout yet: the paged one may be chosen
    assert CacheOptions(block_tokens=8, layout="paged").layout == "paged"
    for name in LAYOUT_NAMES:
        assert CacheOptions(layout=name).layout == name


def test_from_dict_names_unknown_keys_and_the_known_ones() -> None:
    assert CacheOptions.from_dict(None) == CacheOptions()
    assert CacheOptions.from_dict({"layout": "paged", "block_tokens": 4}) == CacheOptions(layout="paged", block_tokens=4)
    with pytest.raises(ValueError, match=r"unknown cache_config key\(s\) \['pages', 'ring'\] for "
                                         r"cache_implementation='vkv'; known keys: \['block_tokens', 'budget_bytes'"):
        CacheOptions.from_dict({"ring": 1, "pages": 2, "layout": "paged"})


@pytest.mark.parametrize("policy", ["model", "head", "layer", "rows"])
def test_the_removed_group_policy_is_refused_naming_its_replacement(policy: str) -> None:
    with pytest.raises(ValueError, match=r"^cache_config\['group_policy'\] is no longer an option: it was replaced "
                                         r"by 'layout' and 'groups': write \{'layout': 'token_major'\} for 'model'"):
        CacheOptions.from_dict({"group_policy": policy})
    with pytest.raises(TypeError):  # not a field any more
        CacheOptions(group_policy=policy)  # type: ignore[call-arg]


# ------------------------------------------------------------------ every option refusal is a VKVError
_BAD_VALUES = [({"layout": "ring"}, ValueError), ({"page_bytes": 0}, ValueError), ({"bad_key": 1}, ValueError),
               ({"group_policy": "model"}, ValueError), ({"offloading": True}, ValueError),
               ({"share_prompts": 1}, TypeError), ({"prefill_once": "yes"}, TypeError)]


@pytest.mark.parametrize("bad, builtin", _BAD_VALUES, ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_option_refusals_are_typed_vkv_errors_and_builtin_errors(bad: dict, builtin: type) -> None:
    """``docs/usage.md``: every refusal is a ``hf_vkv.VKVError`` and the matching built-in type
    (so ``except ValueError`` keeps working): :class:`hf_vkv.CacheOptionError` /
    :class:`hf_vkv.CacheOptionTypeError`, through ``cache_config`` and ``VKVCache(...)`` keywords."""
    import hf_vkv

    typed = hf_vkv.CacheOptionError if builtin is ValueError else hf_vkv.CacheOptionTypeError
    assert issubclass(typed, hf_vkv.VKVError) and issubclass(typed, builtin)
    for error in (hf_vkv.VKVError, builtin, typed):
        with pytest.raises(error):
            CacheOptions.from_dict(bad)
    with pytest.raises(typed):
        CacheOptions.from_dict(bad, given_to="VKVCache")
    with pytest.raises(hf_vkv.CacheOptionTypeError, match="cache_config must be a dict"):
        CacheOptions.from_dict("page_bytes=4096")  # type: ignore[arg-type]
    for key in (None, 1):  # a key that is no option's name (once a TypeError from the "did you mean" hint)
        with pytest.raises(hf_vkv.CacheOptionTypeError, match=f"option names .*got {type(key).__name__} {key!r}"):
            CacheOptions.from_dict({key: 1, "page_bytes": 4096})


def test_vkvcache_keywords_and_generate_cache_config_refusals_are_vkv_errors() -> None:
    """The same, end to end: ``VKVCache(config, bad=...)`` and ``generate(cache_implementation="vkv",
    cache_config={"bad_key": 1})`` on a tiny random Llama."""
    import hf_vkv
    from models import prompts, tiny

    model = tiny("llama")
    for error in (hf_vkv.VKVError, ValueError, hf_vkv.CacheOptionError):
        with pytest.raises(error, match=r"unknown keyword argument\(s\) \['bad'\] for VKVCache\(\)"):
            hf_vkv.VKVCache(model.config, bad=1)
        with pytest.raises(error, match=r"cache_config\['layout'\] must be one of"):
            hf_vkv.VKVCache(model.config, layout="ring")
    with pytest.raises(hf_vkv.CacheOptionTypeError):
        hf_vkv.VKVCache(model.config, share_prompts="yes")
    inputs = prompts(1, 4)
    for error in (hf_vkv.VKVError, ValueError, hf_vkv.CacheOptionError):
        with pytest.raises(error, match=r"unknown cache_config key\(s\) \['bad_key'\] for cache_implementation='vkv'"):
            model.generate(**inputs, max_new_tokens=2, do_sample=False, cache_implementation="vkv",
                           cache_config={"bad_key": 1})
    with pytest.raises(hf_vkv.VKVError):
        model.generate(**inputs, max_new_tokens=2, do_sample=False, cache_implementation="vkv",
                       cache_config={"budget_bytes": -1})

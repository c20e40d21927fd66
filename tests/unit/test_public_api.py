"""The public API is what a user needs, documented name by name, and importing it stays cheap."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import hf_vkv

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_exists_and_is_documented() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\| ((?:`[\w]+`(?:, )?)+) \|", page, re.M))
    names = {n for cell in documented for n in re.findall(r"`(\w+)`", cell)}
    assert names == set(hf_vkv.__all__), (sorted(names - set(hf_vkv.__all__)), sorted(set(hf_vkv.__all__) - names))
    for name in hf_vkv.__all__:
        assert getattr(hf_vkv, name) is not None


def test_every_exported_error_is_a_vkv_error() -> None:
    """``docs/usage.md``: every refusal is a ``hf_vkv.VKVError`` (and a built-in type): each error
    a user can meet is exported, the recurrent-state rollback and the option errors included."""
    errors = [name for name in hf_vkv.__all__ if name.endswith(("Error", "OutOfMemory"))]
    assert {"RecurrentRollbackError", "CacheOptionError", "CacheOptionTypeError"} <= set(errors)
    for name in errors:
        error = getattr(hf_vkv, name)
        assert issubclass(error, hf_vkv.VKVError), name
        builtin = [c for c in error.__mro__ if c.__module__ == "builtins" and c not in (Exception, BaseException, object)]
        assert name == "VKVError" or builtin, f"{name} refines no built-in type"
    from hf_vkv.cache.hybrid import RecurrentRollbackError

    assert hf_vkv.RecurrentRollbackError is RecurrentRollbackError and issubclass(RecurrentRollbackError, RuntimeError)
    assert issubclass(hf_vkv.CacheOptionError, ValueError) and issubclass(hf_vkv.CacheOptionTypeError, TypeError)


def test_internals_are_not_exported_but_stay_importable() -> None:
    for name in ("Arena", "HostBackend", "VirtualBuffer"):
        assert name not in hf_vkv.__all__ and not hasattr(hf_vkv, name)
    from hf_vkv.memory import Arena, HostBackend, VirtualBuffer  # noqa: F401


def test_run_ab_is_imported_when_first_used() -> None:
    code = ("import sys, hf_vkv; assert not [m for m in sys.modules if m.startswith('hf_vkv.ab')]; "
            "from hf_vkv.ab import run_ab; assert hf_vkv.run_ab is run_ab; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]

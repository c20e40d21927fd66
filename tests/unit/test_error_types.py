"""Every error hf_vkv raises on purpose is a ``VKVError``: the package's source raises no builtin
exception class, so ``except hf_vkv.VKVError`` catches every refusal (each error class still
refines the builtin type a caller may catch: ``ArgumentError`` is a ``ValueError``, ...)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import hf_vkv

PACKAGE = Path(hf_vkv.__file__).parent

#: Raises that a Python protocol asks for by name: a module's or a class's ``__getattr__`` says
#: "no such attribute" with ``AttributeError`` (``hasattr`` and ``getattr(..., default)`` catch only it).
PROTOCOL_RAISES = {"AttributeError"}


def _builtin_raises(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if not isinstance(target, ast.Name) or target.id in PROTOCOL_RAISES:
            continue
        thing = getattr(builtins, target.id, None)
        if isinstance(thing, type) and issubclass(thing, BaseException):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: raise {target.id}")
    return found


def test_the_package_raises_no_builtin_exception_class():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _builtin_raises(path)]
    assert not found, "raise a VKVError subclass instead:\n" + "\n".join(found)


def test_the_scan_sees_a_builtin_raise(tmp_path):
    # the check above can fail: a file raising ValueError is found, one raising a VKVError is not
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    if x:\n        raise ValueError('no')\n    raise hf_vkv.ArgumentError('no')\n")
    global PACKAGE
    kept, PACKAGE = PACKAGE, tmp_path
    try:
        assert _builtin_raises(bad) == ["{}:3: raise ValueError".format(Path(tmp_path.name) / "bad.py")]
    finally:
        PACKAGE = kept


def test_each_argument_error_refines_its_builtin_type():
    assert issubclass(hf_vkv.ArgumentError, (hf_vkv.VKVError)) and issubclass(hf_vkv.ArgumentError, ValueError)
    assert issubclass(hf_vkv.ArgumentTypeError, hf_vkv.VKVError) and issubclass(hf_vkv.ArgumentTypeError, TypeError)
    assert issubclass(hf_vkv.CacheIndexError, hf_vkv.VKVError) and issubclass(hf_vkv.CacheIndexError, IndexError)

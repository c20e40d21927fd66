"""transformers is patched in one place: :mod:`hf_vkv.generate.registry`, whose :func:`patches` lists
every wrapped method; nothing else in the package assigns into transformers, and ``import hf_vkv``
changes nothing in transformers beyond that list and its registration entries."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from hf_vkv.generate import registry as registration

PACKAGE = Path(__file__).resolve().parents[2] / "hf_vkv"


def _transformers_names(tree: ast.Module) -> set[str]:
    """Names a module binds to transformers objects (``import transformers as t``, ``from
    transformers.x import Y``, ``from transformers.generation import utils``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "transformers"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "transformers":
            names |= {a.asname or a.name for a in node.names}
    return names


def _assignments_into(tree: ast.Module, names: set[str]) -> list[str]:
    """``setattr(X, ...)``, ``X.attr = ...`` and ``X[...] = ...`` where ``X`` roots in ``names``."""
    def root(node: ast.expr) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [node.args[0]] if node.args else []
        for target in targets:
            if isinstance(target, ast.Name) and not (isinstance(node, ast.Call)):
                continue  # rebinding a local name changes nothing in transformers
            if root(target) in names:
                found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_scan_sees_a_patch() -> None:
    """The scan itself: it finds each way of assigning into transformers (so its silence below means something)."""
    source = ("from transformers.generation.utils import GenerationMixin\nfrom transformers.generation import utils as u\n"
              "import transformers\nsetattr(GenerationMixin, 'generate', None)\nu.ALL = ()\n"
              "transformers.cache_utils.X['a'] = 1\nGenerationMixin = None\n")
    tree = ast.parse(source)
    assert len(_assignments_into(tree, _transformers_names(tree))) == 3


def test_only_registration_assigns_into_transformers() -> None:
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "generate" / "registry.py":
            continue
        tree = ast.parse(path.read_text())
        found = _assignments_into(tree, _transformers_names(tree))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}, f"only hf_vkv/generate/registry.py patches transformers (add it to patches()): {offenders}"


def test_registration_patches_what_it_lists() -> None:
    """Each listed method is wrapped once, marked, and a second ``register()`` changes nothing."""
    listed = registration.patches()
    assert len({(p.owner, p.name) for p in listed}) == len(listed) >= 6
    before = {(p.owner, p.name): getattr(p.owner, p.name) for p in listed}
    for (owner, name), method in before.items():
        assert getattr(method, registration.PATCH_MARK, False), f"{owner.__name__}.{name} is not wrapped"
        assert not getattr(method.__wrapped__, registration.PATCH_MARK, False), f"{owner.__name__}.{name} wrapped twice"
    registration.register()
    assert {(p.owner, p.name): getattr(p.owner, p.name) for p in listed} == before


_SNAPSHOT = r"""
import json, sys, types
import transformers, transformers.generation.utils, transformers.cache_utils, transformers.masking_utils
import transformers.modeling_utils, transformers.integrations.sdpa_attention, transformers.generation.configuration_utils
def snap():
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("transformers") or not isinstance(mod, types.ModuleType):
            continue
        for name, value in list(vars(mod).items()):
            out[f"{mod_name}:{name}"] = id(value)
            if isinstance(value, type) and value.__module__ == mod_name:
                for attr, member in list(vars(value).items()):
                    out[f"{mod_name}:{name}.{attr}"] = id(member)
    return out
before = snap()
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
attn, masks = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)
import hf_vkv
after = snap()
changed = sorted(k for k in before if k in after and before[k] != after[k])
print(json.dumps({"changed": changed, "attention": sorted(set(AttentionInterface._global_mapping) - attn),
                  "masks": sorted(set(AttentionMaskInterface._global_mapping) - masks)}))
"""


def test_import_changes_only_the_listed_names() -> None:
    """In a fresh interpreter: every transformers module and class loaded before ``import hf_vkv``
    keeps every attribute, but for the listed patches and the registration entries."""
    run = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, check=True, timeout=300)
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    expected = {f"{p.owner.__module__}:{p.owner.__name__}.{p.name}" for p in registration.patches()}
    expected.add("transformers.generation.configuration_utils:ALL_CACHE_IMPLEMENTATIONS")
    assert set(seen["changed"]) == expected
    assert seen["attention"] == seen["masks"] == ["vkv_cascade", "vkv_paged"]

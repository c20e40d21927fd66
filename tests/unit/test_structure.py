"""The package's shape, checked: subpackages import one another without cycles, the memory core
imports no transformers, GPU code is imported only when asked for, and a beam step converts
``beam_idx`` to Python once for every group."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

from hf_vkv import VKVCache
from transformers import LlamaConfig

PACKAGE = Path(__file__).resolve().parents[2] / "hf_vkv"


def _subpackage_imports() -> dict[str, set[str]]:
    """``{subpackage: subpackages it imports}`` from the relative imports of every module."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) < 2:
            continue  # top-level modules (registration, devices, cli, ...) may import any subpackage
        here = rel.parts[0]
        deps = graph.setdefault(here, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                target = (node.module or "").split(".")[0]
                if node.level == len(rel.parts) and target and (PACKAGE / target).is_dir() and target != here:
                    deps.add(target)
    return graph


def test_layers_point_one_way() -> None:
    """``cache`` -> ``memory`` only (what it shares with ``attention`` lives in the neutral
    :mod:`hf_vkv.kv_records`, which imports nothing of the package); ``attention`` -> ``memory``
    (its errors are :class:`~hf_vkv.VKVError`); ``memory`` imports no other subpackage."""
    graph = _subpackage_imports()
    assert graph["cache"] == {"memory"}, graph["cache"]
    assert graph["memory"] == set() and graph["attention"] <= {"memory"}, (graph["memory"], graph["attention"])
    neutral = ast.parse((PACKAGE / "kv_records.py").read_text())
    assert not [n for n in ast.walk(neutral) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert not [a.name for n in ast.walk(neutral) if isinstance(n, ast.Import) for a in n.names
                if a.name.split(".")[0] in ("hf_vkv", "transformers")]


def test_subpackages_import_without_cycles() -> None:
    graph = _subpackage_imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError(f"import cycle: {' -> '.join([*path, node])}")
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_memory_imports_no_transformers() -> None:
    """The memory core (``import hf_vkv`` itself registers with transformers, so read the sources)."""
    for path in (PACKAGE / "memory").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("transformers", "hf_vkv") for n in names), (path, names)


def test_slot_means_only_a_page_slot() -> None:
    """"slot" is the memory layer's word (a page-sized place in a reservation: ``hf_vkv.memory``);
    the cache's layer index in its group is a *member*, a token's place in a block its position."""
    import re

    for sub in ("cache", "attention", "ab", "prefix"):
        for path in (PACKAGE / sub).rglob("*.py"):
            text = re.sub(r"slots=True|slots dataclass", "", path.read_text())  # Python's __slots__
            assert not re.search(r"slot", text, re.IGNORECASE), f"{path}: 'slot' outside the memory layer"


def test_importing_hf_vkv_loads_no_gpu_code() -> None:
    """In a fresh interpreter (one for all three checks: it costs seconds): ``import hf_vkv`` and
    the doctor load neither ``hf_vkv.cuda`` nor the CUDA bindings nor the Triton kernels, and
    ``hf_vkv.cuda`` itself loads no bindings until a backend is made. torch may import
    ``cuda.bindings`` itself where installed: the last check compares with what torch and
    transformers loaded before hf_vkv."""
    code = "\n".join([
        "import sys, torch, transformers",
        "before = set(sys.modules)",
        "import hf_vkv, hf_vkv.doctor, hf_vkv.attention, hf_vkv.cache",
        "bad = sorted(m for m in sys.modules if m == 'hf_vkv.cuda' or m.startswith(('hf_vkv.cuda.', 'cuda.')))",
        "assert not bad, ('import hf_vkv / the doctor loaded', bad)",
        "assert 'hf_vkv.attention.triton_paged' not in sys.modules, 'import hf_vkv loaded the Triton kernels'",
        "import hf_vkv.cuda, hf_vkv.devices",
        "bad = sorted(m for m in set(sys.modules) - before if m.startswith('cuda'))",
        "assert not bad, ('import hf_vkv.cuda loaded', bad)",
    ])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr


class _CountingIndex(torch.Tensor):
    calls = 0

    def tolist(self):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        return super().tolist()


def test_a_beam_step_converts_beam_idx_once() -> None:
    config = LlamaConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                         vocab_size=64, intermediate_size=64, max_position_embeddings=64,
                         layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                         sliding_window=8)
    cache = VKVCache(config, page_bytes=4096)
    states = torch.randn(3, 2, 5, 16)
    for layer in range(4):
        cache.update(states, states, layer)
    assert len(cache.groups) == 2
    beam_idx = torch.tensor([2, 2, 0], dtype=torch.int32).as_subclass(_CountingIndex)
    _CountingIndex.calls = 0
    cache.reorder_cache(beam_idx)
    assert _CountingIndex.calls == 1  # once for every group and layer
    assert torch.equal(cache.layers[0].keys, states[[2, 2, 0]])
    cache.check_invariants()

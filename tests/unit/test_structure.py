"""The package's shape, checked: files import one another without cycles, layers point down and
nothing imports the package root, the memory core imports no transformers, GPU code is imported
only when asked for, and a beam step converts ``beam_idx`` to Python once for every group."""

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


ROOT = "__init__.py"  # the package root, as a node of the import graph

#: What each layer of the package may import besides itself and the leaf modules (top-level
#: modules that import nothing of the package: ``kv_records``, ``version``): docs/architecture.md. Parts
#: not listed (``generate``, ``ab``, the top-level tools) are not constrained here beyond (a), (b).
LAYERS: dict[str, set[str]] = {
    "memory": set(),
    "cuda": {"memory"},
    "attention": {"memory"},
    "devices": {"memory", "cuda"},
    "cache": {"memory", "devices"},
    "prefix": {"cache", "memory", "devices"},  # devices: the store's page size (policy lives there)
}


def _module_file(parts: list[str]) -> str | None:
    """The file of module ``hf_vkv.<parts>`` relative to the package (``"cache/layer.py"``,
    ``"cache/__init__.py"``, ``"__init__.py"`` for the root), or None where there is none."""
    base = PACKAGE.joinpath(*parts)
    if parts and base.with_suffix(".py").is_file():
        return "/".join(parts) + ".py"
    if (base / "__init__.py").is_file():
        return "/".join([*parts, ROOT])
    return None


def _import_targets(rel: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The files of the package that one import statement of file ``rel`` loads. ``from .pkg
    import name`` goes to ``pkg/name.py`` (or ``pkg/name/__init__.py``) where that is a module,
    else to ``pkg``'s own file; an unresolvable import gives ``"<unresolved ...>"``."""
    here = list(rel.parts[:-1])  # the package the file is in (an __init__.py is in its own)
    if isinstance(node, ast.Import):
        names = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "hf_vkv"]
        return [_module_file(n[1:]) or f"<unresolved import {'.'.join(n)}>" for n in names]
    module = (node.module or "").split(".") if node.module else []
    if node.level:
        if node.level - 1 > len(here):
            return [f"<unresolved from {'.' * node.level}{node.module or ''}>"]
        mod = here[: len(here) - (node.level - 1)] + module
    elif module[:1] == ["hf_vkv"]:
        mod = module[1:]
    else:
        return []  # not the package
    own = _module_file(mod)
    return [_module_file([*mod, a.name]) or own or f"<unresolved from {'.'.join(['hf_vkv', *mod])}>"
            for a in node.names]


def _import_graph() -> dict[str, set[str]]:
    """``{file: files of hf_vkv it imports}`` for every module of the package, top-level modules
    and ``__init__.py`` files included. Every import statement counts wherever it stands: at module
    level, inside a function (a deferred import is still an arrow, and a circle hidden in a
    function is still a circle) and under ``if TYPE_CHECKING:`` (a module that must name a higher
    one, even for annotations, is not below it)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        deps = graph.setdefault(rel.as_posix(), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_import_targets(rel, node))
        deps.discard(rel.as_posix())
    return graph


def _part(file: str) -> str:
    """The part of the package a file belongs to: its subpackage, or its own name at top level."""
    return file.split("/")[0] if "/" in file else file.removesuffix(".py")


def _cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Every strongly connected component of more than one file (Tarjan), as ``(one shortest
    circle through it, every arrow inside it)``: each is a set of files that import one another."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for component in components:
        members = set(component)
        start = component[0]
        previous: dict[str, str] = {}  # breadth first from start back to start, inside the component
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w not in previous:
                        previous[w] = v
                        following.append(w)
            frontier = following
        circle = [start]
        while len(circle) == 1 or circle[-1] != start:
            circle.append(previous[circle[-1]])
        arrows = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        out.append((circle[::-1], arrows))
    return out


def test_every_package_import_resolves() -> None:
    """The graph below is only as good as its resolver: every hf_vkv import names a file."""
    bad = sorted(f"{a} -> {b}" for a, deps in _import_graph().items() for b in deps if b.startswith("<"))
    assert not bad, "imports of hf_vkv that name no module:\n  " + "\n  ".join(bad)


def test_files_import_without_cycles() -> None:
    """(a) No circle of imports between files, anywhere in the package: one concept per module,
    dependencies one way. A module inside a package imports its siblings directly, never through
    its own package's ``__init__.py`` (which imports them: that is a circle)."""
    cycles = _cycles(_import_graph())
    report = "\n".join(
        f"  cycle: {' -> '.join(circle)}\n    arrows inside it: " + "; ".join(arrows) for circle, arrows in cycles)
    assert not cycles, f"{len(cycles)} file-level import cycle(s):\n{report}"


def test_nothing_imports_the_package_root() -> None:
    """(b) No arrow up to ``hf_vkv/__init__.py``: what a module needs of the root (the version)
    comes from the leaf it comes from (:mod:`hf_vkv.version`)."""
    graph = _import_graph()
    bad = sorted(f"{a} -> {ROOT}" for a, deps in graph.items() if a != ROOT and ROOT in deps)
    assert not bad, "modules that import the package root hf_vkv/__init__.py:\n  " + "\n  ".join(bad)


def test_layers_point_one_way() -> None:
    """(c) The layers of docs/architecture.md, file by file: ``memory`` imports no other part of hf_vkv;
    ``cuda`` and ``attention`` -> ``memory``; ``cache`` -> ``memory``, ``devices``; ``prefix``
    -> ``cache``, ``memory`` (and ``devices``, as ``cache`` does); each may also import leaf
    modules (top-level modules that import nothing of the package, such as :mod:`hf_vkv.kv_records`,
    :mod:`hf_vkv.version`). So ``cache`` reaches neither ``prefix`` nor ``generate``, ``ab``,
    ``registration`` or ``prefill_once``."""
    graph = _import_graph()
    leaves = {_part(f) for f, deps in graph.items() if "/" not in f and f != ROOT and not deps}
    bad = sorted(
        f"{a} -> {b}" for a, deps in graph.items() if _part(a) in LAYERS for b in deps
        if _part(b) != _part(a) and _part(b) not in LAYERS[_part(a)] | leaves)
    assert not bad, "imports against the layering (docs/architecture.md):\n  " + "\n  ".join(bad)


def _architecture_table() -> dict[str, set[str]]:
    """``{part: parts it imports}`` as the table of docs/architecture.md ("| part | imports | why |")
    states it (the backquoted names of its second column)."""
    import re

    table: dict[str, set[str]] = {}
    lines = (PACKAGE.parent / "docs" / "architecture.md").read_text().splitlines()
    start = lines.index("| part | imports | why |") + 2  # past the header and its rule
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        table[cells[0].strip("`").removesuffix(".py")] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return table


def test_the_architecture_table_is_the_import_graph() -> None:
    """docs/architecture.md's table of what each part imports is the import graph, part by part:
    every import it lists exists, and every one that exists is listed."""
    table = _architecture_table()
    assert {"memory", "cache", "prefix", "generate", "__init__"} <= set(table), sorted(table)
    actual: dict[str, set[str]] = {}
    for a, deps in _import_graph().items():
        part = "__init__" if a == ROOT else _part(a)
        if part in table:
            actual.setdefault(part, set()).update(
                "__init__" if b == ROOT else _part(b) for b in deps if (_part(b) if b != ROOT else "__init__") != part)
    wrong = {part: {"listed, not imported": sorted(table[part] - actual.get(part, set())),
                    "imported, not listed": sorted(actual.get(part, set()) - table[part])}
             for part in table if table[part] != actual.get(part, set())}
    assert not wrong, f"docs/architecture.md's import table differs from the code: {wrong}"


def test_leaf_modules_import_nothing() -> None:
    """``kv_records`` (what ``cache`` shares with ``attention``) and ``version`` import nothing of
    the package, and ``kv_records`` nothing of transformers either."""
    for name in ("kv_records", "version"):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0], name
        assert not [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                    if a.name.split(".")[0] in ("hf_vkv", "transformers")], name
        assert not [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
                    and (n.module or "").split(".")[0] in ("hf_vkv", "transformers")], name


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

"""Executable specs of the radix tree of :mod:`hf_vkv.prefix.radix` on its own: exact nodes,
edges and keys after each change, the matches of a query, and the invariant check catching a
broken tree. The prefix store over it is tested end to end in ``tests/integration/test_prefix.py``.
"""

from __future__ import annotations

import random

import pytest

from hf_vkv.memory import InvariantError
from hf_vkv.prefix import RadixTree


def shape(tree: RadixTree) -> dict[tuple[int, ...], object]:
    """Every node below the root as ``{path of edges: key}``: the exact structure of the tree."""
    out: dict[tuple[int, ...], object] = {}
    stack = [((), tree._root)]
    while stack:
        path, node = stack.pop()
        for child in node.children.values():
            here = path + (child.edge,)
            out[here] = child.key
            stack.append((here, child))
    return out


def test_radix_tree_exact_matches() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 5], "b")  # splits the edge after [1, 2]
    tree.insert([1, 2], "c")  # a key on the split node
    tree.insert([7], "d")
    tree.check_invariants()
    got = tree.common_prefixes([1, 2, 3, 9])
    assert got[0] == (3, "a") and sorted(got[1:]) == [(2, "b"), (2, "c")]
    assert tree.common_prefixes([1, 2, 3, 4, 5])[0] == (4, "a")
    assert sorted(tree.common_prefixes([1])) == [(1, "a"), (1, "b"), (1, "c")]
    assert tree.common_prefixes([8, 1]) == [] and tree.common_prefixes([]) == []
    assert tree.get([1, 2]) == "c" and tree.get([1]) is None and tree.get([1, 2, 3]) is None
    assert tree.insert([1, 2, 5], "e") == "b"  # replaced
    tree.remove("c")
    tree.check_invariants()
    tree.remove("a")  # [1, 2] is keyless with one child now: merged
    tree.check_invariants()
    assert tree.tokens("e") == (1, 2, 5) and len(tree) == 2
    with pytest.raises(KeyError):
        tree.remove("a")
    with pytest.raises(ValueError, match="at least one token"):
        tree.insert([], "z")


def test_radix_tree_against_brute_force() -> None:
    rng = random.Random(0)
    tree: RadixTree[int] = RadixTree()
    stored: dict[int, tuple[int, ...]] = {}
    for step in range(600):
        if stored and rng.random() < 0.3:
            key = rng.choice(list(stored))
            tree.remove(key)
            del stored[key]
        else:
            tokens = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 8)))
            replaced = tree.insert(tokens, step)
            if replaced is not None:
                assert stored.pop(replaced) == tokens
            stored[step] = tokens
        tree.check_invariants()
        query = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 9)))
        expected = {}
        for key, tokens in stored.items():
            n = next((i for i, (a, b) in enumerate(zip(tokens, query)) if a != b), min(len(tokens), len(query)))
            if n:
                expected[key] = n
        got = tree.common_prefixes(query)
        assert dict((k, n) for n, k in got) == expected and len(got) == len(expected)
        assert [n for n, _ in got] == sorted((n for n, _ in got), reverse=True)


def test_an_insert_splits_an_edge_and_a_remove_merges_it_back() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert([1, 2, 3, 4], "a")
    assert shape(tree) == {((1, 2, 3, 4),): "a"}
    tree.insert([1, 2, 5], "b")  # the edge splits after [1, 2], a keyless node with two children
    assert shape(tree) == {((1, 2),): None, ((1, 2), (3, 4)): "a", ((1, 2), (5,)): "b"}
    tree.insert([1, 2, 3, 4, 6], "c")  # below a key: a new leaf, no split
    assert shape(tree)[((1, 2), (3, 4), (6,))] == "c"
    tree.check_invariants()
    tree.remove("b")  # [1, 2] keyless with one child: merged into [1, 2, 3, 4]
    assert shape(tree) == {((1, 2, 3, 4),): "a", ((1, 2, 3, 4), (6,)): "c"}
    tree.remove("a")  # a key on an inner node with one child: merged again
    assert shape(tree) == {((1, 2, 3, 4, 6),): "c"}
    tree.remove("c")
    assert shape(tree) == {} and len(tree) == 0 and "c" not in tree
    tree.check_invariants()


def test_keys_are_stored_once_and_items_list_them() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert([5, 6], "x")
    with pytest.raises(ValueError, match="'x' is already stored; remove it first"):
        tree.insert([7], "x")
    assert tree.insert([5, 6], "y") == "x"  # the same tokens: the old key is replaced and returned
    assert "x" not in tree and tree.get([5, 6]) == "y"
    tree.insert([5], "z")
    assert sorted(tree.items()) == [((5,), "z"), ((5, 6), "y")]
    assert tree.common_prefixes([5, 6, 7]) == [(2, "y"), (1, "z")]  # longest first
    assert sorted(tree.common_prefixes([5, 9])) == [(1, "y"), (1, "z")]


@pytest.mark.parametrize("corrupt, message", [
    (lambda t: setattr(t._root.children[1], "edge", ()), r"filed under 1 starts with \(\)"),
    (lambda t: setattr(t._root.children[1], "parent", None), "not filed under its parent"),
    (lambda t: t._root.children.__setitem__(9, t._root.children.pop(1)), "filed under 9 starts with"),
    (lambda t: setattr(t._root.children[1].children[3], "key", None), "keyless radix node"),
    (lambda t: setattr(t._root.children[1].children[5], "key", "a"), "stored twice"),
    (lambda t: t._where.pop("b"), "the key index lists 1 keys, the tree holds 2"),
    (lambda t: setattr(t._root, "key", "r"), "root holds a key"),
])
def test_check_invariants_catches_a_broken_tree(corrupt, message) -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert([1, 2, 3], "a")
    tree.insert([1, 2, 5], "b")  # root -> [1, 2] -> {[3]: a, [5]: b}
    tree.check_invariants()
    corrupt(tree)
    with pytest.raises(InvariantError, match=message):
        tree.check_invariants()

"""A radix tree over token ids: which stored prefixes share how many leading tokens with a query.

Pure bookkeeping (no tensors, no caches): every stored sequence of token ids carries a key (the
prefix store uses entry ids), and :meth:`RadixTree.common_prefixes` tells, for a query, each
key whose tokens share at least one leading token with it and how many. Matching compares the
token ids themselves, edge by edge; nothing is ever matched by a hash.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..memory.errors import ArgumentError, InvariantError

__all__ = ["RadixTree"]

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True, eq=False)
class _Node(Generic[K]):
    edge: tuple[int, ...]  # token ids on the edge from the parent (empty only at the root)
    parent: _Node[K] | None  # None only at the root
    children: dict[int, _Node[K]] = field(default_factory=dict)  # first token of a child's edge -> child
    key: K | None = None  # the key stored for the tokens that end exactly here


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixTree(Generic[K]):
    """Keys stored under sequences of token ids, with edges compressed (a radix / Patricia tree).

    Invariants (checked by :meth:`check_invariants`):

    * every node but the root has a non-empty edge and is filed in its parent's ``children``
      under its edge's first token, and its ``parent`` is that parent;
    * a node other than the root holds a key or has at least two children (no chain of
      keyless single-child nodes, no keyless leaf);
    * each key is stored once, and ``len(tree)`` counts the keys.
    """

    def __init__(self) -> None:
        self._root: _Node[K] = _Node(edge=(), parent=None)
        self._where: dict[K, _Node[K]] = {}  # key -> the node holding it

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    # ----------------------------------------------------------------------------- changes
    def insert(self, tokens: Sequence[int], key: K) -> K | None:
        """Store ``key`` under ``tokens`` (at least one token); return the key it replaced there."""
        tokens = tuple(tokens)
        if not tokens:
            raise ArgumentError("tokens must hold at least one token id")
        if key in self._where:
            raise ArgumentError(f"key {key!r} is already stored; remove it first")
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(edge=tokens[depth:], parent=node)
                node.children[tokens[depth]] = leaf
                node, depth = leaf, len(tokens)
                break
            n = _common_length(child.edge, tokens[depth:])
            if n < len(child.edge):
                child = self._split(child, n)
            node, depth = child, depth + n
        replaced, node.key = node.key, key
        if replaced is not None:
            del self._where[replaced]
        self._where[key] = node
        return replaced

    def remove(self, key: K) -> None:
        """Forget ``key`` (``KeyError`` if absent) and recompress the path it ended on."""
        node = self._where.pop(key)
        node.key = None
        self._prune(node)

    def tokens(self, key: K) -> tuple[int, ...]:
        """The token ids ``key`` is stored under."""
        node = self._where[key]
        parts: list[tuple[int, ...]] = []
        while node.parent is not None:
            parts.append(node.edge)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    # ----------------------------------------------------------------------------- queries
    def get(self, tokens: Sequence[int]) -> K | None:
        """The key stored under exactly ``tokens``, if any."""
        depth, node, partial = self._descend(tuple(tokens))
        return node.key if depth == len(tokens) and partial is None else None

    def common_prefixes(self, tokens: Sequence[int]) -> list[tuple[int, K]]:
        """``(n, key)`` for every key whose tokens share their first ``n >= 1`` tokens with
        ``tokens`` (``n`` as large as it goes), longest ``n`` first."""
        tokens = tuple(tokens)
        path: list[tuple[_Node[K], int]] = []  # (node, tokens every key under it shares with the query)
        node, depth = self._root, 0
        while True:
            path.append((node, depth))
            if depth == len(tokens):
                break
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = _common_length(child.edge, tokens[depth:])
            if n < len(child.edge):
                path.append((child, depth + n))  # the query ends or leaves inside this edge
                break
            node, depth = child, depth + n
        out: list[tuple[int, K]] = []
        below: _Node[K] | None = None  # the deeper path node, whose keys are listed already
        for node, shared in reversed(path):
            if shared == 0:
                break
            for key in self._keys_under(node, skip=below):
                out.append((shared, key))
            below = node
        return out

    def items(self) -> Iterator[tuple[tuple[int, ...], K]]:
        """Every ``(tokens, key)``, in no particular order."""
        for key in list(self._where):
            yield self.tokens(key), key

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` unless every invariant in the class docstring holds."""
        seen: dict[K, _Node[K]] = {}
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node is not self._root:
                if not node.edge:
                    raise InvariantError("a non-root radix node has an empty edge")
                if node.parent is None or node.parent.children.get(node.edge[0]) is not node:
                    raise InvariantError(f"radix node {node.edge[:4]}... is not filed under its parent")
                if node.key is None and len(node.children) < 2:
                    raise InvariantError(f"keyless radix node {node.edge[:4]}... has {len(node.children)} children")
            elif node.key is not None or node.edge:
                raise InvariantError("the radix root holds a key or an edge")
            for first, child in node.children.items():
                if child.edge[:1] != (first,):
                    raise InvariantError(f"radix child filed under {first} starts with {child.edge[:1]}")
                stack.append(child)
            if node.key is not None:
                if node.key in seen:
                    raise InvariantError(f"key {node.key!r} is stored twice")
                seen[node.key] = node
        if seen != self._where:
            raise InvariantError(f"the key index lists {len(self._where)} keys, the tree holds {len(seen)}")

    # ----------------------------------------------------------------------------- internals
    def _descend(self, tokens: tuple[int, ...]) -> tuple[int, _Node[K], _Node[K] | None]:
        """Follow ``tokens``: (tokens matched, last whole node, the child entered partly or None)."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                return depth, node, None
            n = _common_length(child.edge, tokens[depth:])
            if n < len(child.edge):
                return depth + n, node, child
            node, depth = child, depth + n
        return depth, node, None

    def _split(self, child: _Node[K], n: int) -> _Node[K]:
        """Cut ``child``'s edge after ``n`` tokens (0 < n < len); return the new middle node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.edge)
        middle = _Node(edge=child.edge[:n], parent=parent)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[n:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def _prune(self, node: _Node[K]) -> None:
        """Restore compression after ``node`` lost its key."""
        while node.parent is not None and node.key is None:
            parent = node.parent
            if not node.children:  # a keyless leaf goes
                del parent.children[node.edge[0]]
                node = parent
                continue
            if len(node.children) == 1:  # a keyless single-child node merges into its child
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
            break

    def _keys_under(self, node: _Node[K], *, skip: _Node[K] | None) -> Iterator[K]:
        stack = [node]
        while stack:
            n = stack.pop()
            if n is skip:
                continue
            if n.key is not None:
                yield n.key
            stack.extend(n.children.values())

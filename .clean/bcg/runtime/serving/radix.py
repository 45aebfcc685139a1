"""The prefix cache's radix tree over token ids: its nodes, and the walks that read it without the cache's counts.

Each :class:`Node` holds a run of tokens (its edge) and the pool slots holding their KV, so the path from the root to
a node spells a prefix and lists its slots in position order; children are keyed by their first token. A prefix may
end anywhere, inside an edge too: :func:`walk` says where, and :func:`split` cuts the edge there. The tree's lock,
locks, ages and eviction are the cache's (:mod:`bcg.runtime.serving.prefix_cache`); these run under its lock.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EMPTY", "Node", "common_length", "split", "walk"]

EMPTY = np.empty(0, dtype=np.int64)


class Node:
    """One edge of the tree: ``key`` (its tokens), ``slots`` (their KV slots), the parent, the children by first
    token, the locks counted on it (``lock_ref``) and its last access (the cache's clock)."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "slots")

    def __init__(self, key: np.ndarray, slots: np.ndarray, parent: Node | None) -> None:
        self.key, self.slots, self.parent = key, slots, parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = 0


def common_length(key: np.ndarray, tokens: np.ndarray, i: int, n: int) -> int:
    """Tokens ``key`` shares with ``tokens[i:n]`` from its start (at least one: the child was found by it)."""
    m = min(len(key), n - i)
    eq = key[:m] == tokens[i : i + m]
    return m if eq.all() else int(np.argmin(eq))


def walk(root: Node, tokens: np.ndarray, limit: int) -> tuple[Node, int, list[np.ndarray], int]:
    """The deepest node under ``root`` matching ``tokens[:limit]``, the length matched, its slots in parts, and where
    inside that node's edge the match ends (0: at its end)."""
    node, i, parts = root, 0, []
    limit = min(limit, len(tokens))
    while i < limit:
        child = node.children.get(int(tokens[i]))
        if child is None:
            break
        j = common_length(child.key, tokens, i, limit)
        parts.append(child.slots[:j])
        node, i = child, i + j
        if j < len(child.key):  # ends inside this edge
            return node, i, parts, j
    return node, i, parts, 0


def split(child: Node, j: int) -> Node:
    """Cuts ``child``'s edge after ``j`` tokens; returns the new upper node (locks and age copied, so every lock
    taken through ``child`` still counts on the path). The tree has one node more."""
    top = Node(child.key[:j], child.slots[:j], child.parent)
    top.lock_ref, top.last_access = child.lock_ref, child.last_access
    top.children[int(child.key[j])] = child
    child.parent.children[int(child.key[0])] = top
    child.key, child.slots, child.parent = child.key[j:], child.slots[j:], top
    return top

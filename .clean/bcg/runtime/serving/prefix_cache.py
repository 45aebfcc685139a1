"""The prefix cache: the KV of prompt prefixes kept in the pool, in a radix tree over token ids.

Each node of the tree (:mod:`.radix`) holds a run of tokens (its edge) and the pool slots holding their KV, so the
path from the root to a node spells a prefix and lists its slots in position order; children are keyed by their first
token. It is token-granular (a prefix may end anywhere, inside an edge too), and it knows slots only as indices, so it
serves any pool layout: a native model's K/V, a DSA model's index keys, a transformers model's per-layer buffers
(:meth:`KVPool.for_layers <bcg.ops.kv_cache.KVPool.for_layers>`) are all indexed by the same slot.

A request that reads a prefix locks the deepest node it reads (:meth:`PrefixCache.lookup`, which splits an edge the
hit ends inside, so the lock covers exactly what is read): a lock counts on the node and every ancestor, and only
leaves that nobody locks are evicted, least recently used first (:meth:`PrefixCache.evict`). Whoever shares the pool
with the cache allocates through :meth:`PrefixCache.alloc`, which evicts for the shortfall first: the cache calls
down into the pool, never the pool up into the cache. So what a running prefill reads is never evicted. When a
request's KV is written, :meth:`PrefixCache.insert` adopts the slots of the tokens the tree did not have yet (and
locks the node in the same step when asked); slots of tokens another request cached meanwhile stay the request's
own, to free when it ends.

Thread-safe: one lock around the tree; the pool is called outside it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from bcg.ops.kv_cache import KVPool, KVPoolFullError
from bcg.runtime.serving.radix import EMPTY, Node, common_length, split, walk

__all__ = ["CacheHit", "PrefixCache"]

@dataclass
class CacheHit:
    """A locked prefix: ``length`` tokens whose KV sits in ``slots`` (position order). Give it back with
    :meth:`PrefixCache.unlock` (``node``), after the last forward that reads it was launched."""

    length: int
    slots: np.ndarray
    node: Node | None


class PrefixCache:
    """Prompt prefixes kept in ``pool``: looked up and locked by requests, inserted when their KV is written, evicted
    least recently used under pressure.

    Example:
        >>> pool = KVPool(num_slots=16, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> cache = PrefixCache(pool)
        >>> prompt = np.array([5, 6, 7, 8])
        >>> slots = pool.alloc(4).numpy()
        >>> node, adopted_from = cache.insert(prompt, slots)       # the tree now owns the four slots
        >>> adopted_from, cache.num_cached_tokens
        (0, 4)
        >>> hit = cache.lookup(np.array([5, 6, 9]), max_tokens=2)  # a later prompt sharing two tokens
        >>> hit.length, hit.slots.tolist()
        (2, [0, 1])
        >>> cache.evict(4)                                         # locked: nothing to evict
        0
        >>> cache.unlock(hit.node); cache.evict(4), pool.num_free
        (4, 16)
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._root = Node(EMPTY, EMPTY, None)
        self._lock = threading.Lock()
        self._clock = 0
        self._seq = itertools.count()
        # Candidates for eviction: (last_access, seq, node), checked when popped (a node may have been locked, grown
        # a child, been touched again or been evicted since it was pushed); rebuilt when stale entries pile up.
        self._heap: list[tuple[int, int, Node]] = []
        self.num_cached_tokens = 0  # slots the tree holds
        self.num_locked_tokens = 0  # of which in nodes some request locks (the rest can be evicted)
        self.num_nodes = 0
        self.num_evicted_tokens = 0

    # ---------------------------------------------------------------- lookups and inserts
    def lookup(self, tokens: np.ndarray, max_tokens: int) -> CacheHit:
        """The longest cached prefix of ``tokens`` up to ``max_tokens`` tokens, locked until :meth:`unlock`.

        A request asks for at most ``len(tokens) - 1``: its last token must run to produce logits.
        """
        with self._lock:
            node, length, parts, inside = walk(self._root, tokens, max_tokens)
            if length == 0:
                return CacheHit(0, EMPTY, None)
            if inside:  # the hit ends inside the node's edge: lock only what it reads, the rest stays evictable
                node = self._split(node, inside)
            self._touch(node)
            self._lock_node(node)
            return CacheHit(length, parts[0] if len(parts) == 1 else np.concatenate(parts), node)

    def insert(self, tokens: np.ndarray, slots: np.ndarray, lock: bool = False) -> tuple[Node, int]:
        """Caches ``tokens`` whose KV sits in ``slots``; returns the deepest node of the prefix and how many leading
        tokens the tree already had. The tree adopts ``slots[adopted_from:]``; the rest stay the caller's (the
        tree's own slots hold those tokens, which the caller's equal where it read them from the tree).

        With ``lock`` the node comes back locked (:meth:`unlock` it), in the same step: a new leaf is evictable the
        moment the tree's lock is let go, and a request still writing behind it must never see it evicted (another
        thread's allocation evicts at any time)."""
        n = len(tokens)
        with self._lock:
            node, i = self._root, 0
            while i < n:
                child = node.children.get(int(tokens[i]))
                if child is None:
                    break
                j = common_length(child.key, tokens, i, n)
                if j < len(child.key):
                    if i + j == n:  # ends inside this edge: the tree has it all
                        node, i = child, n
                        break
                    child = self._split(child, j)
                node, i = child, i + j
            adopted_from = i
            if i < n:
                leaf = Node(tokens[i:].copy(), np.ascontiguousarray(slots[i:n]).copy(), node)
                node.children[int(tokens[i])] = leaf
                self.num_nodes += 1
                self.num_cached_tokens += n - i
                node = leaf
            if node is not self._root:
                self._touch(node)
                if lock:
                    self._lock_node(node)
            return node, adopted_from

    def lock(self, node: Node | None) -> None:
        """Locks ``node`` and its ancestors against eviction (None: nothing)."""
        if node is not None:
            with self._lock:
                self._lock_node(node)

    def unlock(self, node: Node | None) -> None:
        """Gives back one lock of ``node`` (from :meth:`lookup` or :meth:`lock`)."""
        if node is None:
            return
        with self._lock:
            n: Node | None = node
            while n is not None and n is not self._root:
                n.lock_ref -= 1
                if n.lock_ref == 0:
                    self.num_locked_tokens -= len(n.slots)
                n = n.parent
            if node.lock_ref == 0 and not node.children and node.parent is not None:
                self._push(node)

    # ---------------------------------------------------------------- allocation and eviction
    def alloc(self, n: int) -> torch.Tensor:
        """``n`` slots of the pool (:meth:`KVPool.alloc <bcg.ops.kv_cache.KVPool.alloc>`), evicting unlocked
        prefixes for the shortfall when too few are free.

        Raises:
            KVPoolFullError: too few slots even so; nothing was allocated, and nothing evicted when eviction could
                not have made room.
        """
        try:
            return self.pool.alloc(n)
        except KVPoolFullError:
            self.evict(n - self.pool.num_free)
            return self.pool.alloc(n)

    def evict(self, num_tokens: int) -> int:
        """Frees at least ``num_tokens`` slots to the pool, least recently used leaves first, and returns how many it
        freed; nothing when the unlocked entries hold fewer (an allocation that cannot succeed empties no cache)."""
        return self._evict(num_tokens, partial=False)

    def clear(self) -> int:
        """Evicts every unlocked entry; returns the slots freed (entries that running requests lock stay)."""
        return self._evict(self.num_cached_tokens, partial=True)

    @property
    def num_evictable_tokens(self) -> int:
        """Slots an eviction could free now (every unlocked node: what a lock protects is its node's path)."""
        return self.num_cached_tokens - self.num_locked_tokens

    def _evict(self, num_tokens: int, partial: bool) -> int:
        freed: list[np.ndarray] = []
        total = 0
        with self._lock:
            if not partial and self.num_cached_tokens - self.num_locked_tokens < num_tokens:
                return 0
            rebuilt = False
            while total < num_tokens:
                if not self._heap:
                    if rebuilt:
                        break
                    self._rebuild()
                    rebuilt = True
                    continue
                stamp, _, node = heapq.heappop(self._heap)
                if stamp != node.last_access or not self._evictable(node):
                    continue
                parent = node.parent
                del parent.children[int(node.key[0])]
                node.parent = None
                freed.append(node.slots)
                total += len(node.slots)
                self.num_nodes -= 1
                if parent is not self._root and not parent.children and parent.lock_ref == 0:
                    self._push(parent)
            self.num_cached_tokens -= total
            self.num_evicted_tokens += total
            if len(self._heap) > 4 * self.num_nodes + 64:
                self._rebuild()
        if freed:
            self.pool.free(torch.from_numpy(np.sort(np.concatenate(freed))), check=False)
        return total

    def count_locked_tokens(self) -> int:
        """Slots of entries some request locks, counted by walking the tree (checks :attr:`num_locked_tokens`)."""
        with self._lock:
            stack, total = list(self._root.children.values()), 0
            while stack:
                node = stack.pop()
                total += len(node.slots) if node.lock_ref else 0
                stack.extend(node.children.values())
            return total

    def stats(self) -> dict[str, int]:
        """Tokens cached, locked and evicted so far, and the number of nodes."""
        return {"cached_tokens": self.num_cached_tokens, "locked_tokens": self.num_locked_tokens,
                "evicted_tokens": self.num_evicted_tokens, "nodes": self.num_nodes}

    # ---------------------------------------------------------------- internals (under the lock)
    def _split(self, child: Node, j: int) -> Node:
        top = split(child, j)
        self.num_nodes += 1
        return top

    def _touch(self, node: Node) -> None:
        self._clock += 1
        n: Node | None = node
        while n is not None and n is not self._root:
            n.last_access = self._clock
            n = n.parent
        if self._evictable(node):
            self._push(node)

    def _lock_node(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self._root:
            n.lock_ref += 1
            if n.lock_ref == 1:
                self.num_locked_tokens += len(n.slots)
            n = n.parent

    def _evictable(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def _rebuild(self) -> None:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if self._evictable(node):
                leaves.append((node.last_access, next(self._seq), node))
            stack.extend(node.children.values())
        heapq.heapify(leaves)
        self._heap = leaves

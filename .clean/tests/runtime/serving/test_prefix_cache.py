"""The radix tree of cached prefixes: token-granular hits, splits, adoption, locks, least-recently-used eviction and
allocation through the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bcg.ops.kv_cache import KVPool, KVPoolFullError
from bcg.runtime.serving.prefix_cache import PrefixCache


def make(num_slots: int = 64) -> tuple[KVPool, PrefixCache]:
    pool = KVPool(num_slots=num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    return pool, PrefixCache(pool)


def cache_prompt(pool: KVPool, cache: PrefixCache, tokens: list[int]) -> np.ndarray:
    """Allocates slots for ``tokens``, inserts them and gives back what the tree did not adopt (as a request does)."""
    toks = np.array(tokens)
    slots = pool.alloc(len(toks)).numpy()
    _, adopted_from = cache.insert(toks, slots)
    if adopted_from:
        pool.free(torch.from_numpy(np.sort(slots[:adopted_from])))
    return slots


def test_hits_are_token_granular_and_branches_split_an_edge() -> None:
    pool, cache = make()
    a = cache_prompt(pool, cache, [1, 2, 3, 4, 5])
    assert cache.num_nodes == 1
    b = int(pool.alloc(1)[0])
    _, adopted_from = cache.insert(np.array([1, 2, 3, 9]), np.array([a[0], a[1], a[2], b]))
    assert adopted_from == 3 and cache.num_nodes == 3  # [1 2 3] -> {[4 5], [9]}
    assert cache.num_cached_tokens == 6
    hit = cache.lookup(np.array([1, 2, 3, 9, 7]), max_tokens=4)
    assert (hit.length, hit.slots.tolist()) == (4, [a[0], a[1], a[2], b])
    cache.unlock(hit.node)
    hit = cache.lookup(np.array([1, 2, 7]), max_tokens=2)  # ends inside an edge: split, the lock covers [1 2] only
    assert (hit.length, hit.slots.tolist(), cache.num_nodes) == (2, a[:2].tolist(), 4)
    assert cache.num_locked_tokens == 2 == cache.count_locked_tokens() and cache.num_evictable_tokens == 4
    cache.unlock(hit.node)
    assert cache.lookup(np.array([8, 1]), max_tokens=1).length == 0
    assert cache.lookup(np.array([1, 2, 3]), max_tokens=0).length == 0


def test_insert_reports_what_the_tree_had_and_adopts_only_the_rest() -> None:
    pool, cache = make()
    a = cache_prompt(pool, cache, [1, 2, 3])
    mine = pool.alloc(5).numpy()  # a request that computed [1 2 3] itself while another cached it
    _, adopted_from = cache.insert(np.array([1, 2, 3, 4, 5]), mine)
    assert adopted_from == 3  # mine[:3] stay the request's (the tree keeps a's); mine[3:] are the tree's now
    hit = cache.lookup(np.array([1, 2, 3, 4, 5, 6]), max_tokens=5)
    assert hit.slots.tolist() == [*a.tolist(), *mine[3:].tolist()]
    cache.unlock(hit.node)
    _, again = cache.insert(np.array([1, 2]), np.array([mine[0], mine[1]]))  # all cached: nothing new
    assert again == 2 and cache.num_cached_tokens == 5


def test_locks_protect_the_path_and_eviction_is_least_recently_used_leaves_first() -> None:
    pool, cache = make(16)
    for prompt in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10]):
        cache_prompt(pool, cache, prompt)
    # [1 2] -> {[3 4], [5 6]}, [7 8 9 10]; touch [1 2 5 6] so [3 4] and then [7 8 9 10] are the oldest
    cache.unlock(cache.lookup(np.array([1, 2, 5, 6, 0]), max_tokens=4).node)
    assert cache.evict(1) == 2  # the oldest leaf: [3 4]
    assert cache.lookup(np.array([1, 2, 3, 0]), max_tokens=3).length == 2
    cache.unlock(cache._root.children[1])
    held = cache.lookup(np.array([1, 2, 5, 6, 0]), max_tokens=4)
    assert cache.evict(100) == 0  # more than the unlocked entries hold: nothing goes
    assert cache.num_evictable_tokens == 4 and cache.evict(3) == 4  # [7 8 9 10]; [1 2 5 6] and [1 2] are locked
    assert cache.num_cached_tokens == 4 and cache.num_locked_tokens == 4 and cache.evict(1) == 0
    cache.unlock(held.node)
    assert cache.evict(4) == 4  # the leaf, then its parent once it became a leaf
    assert cache.num_cached_tokens == 0 and cache.num_nodes == 0 and pool.num_free == 16


def test_alloc_evicts_unlocked_prefixes_before_it_refuses() -> None:
    pool, cache = make(8)
    cache_prompt(pool, cache, [1, 2, 3, 4, 5, 6])
    held = cache.lookup(np.array([1, 2, 3, 4, 5, 6, 9]), max_tokens=6)  # a running request reads all six
    slots = cache.alloc(2)
    assert pool.num_free == 0 and cache.num_cached_tokens == 6
    with pytest.raises(KVPoolFullError):  # the locked node holds all six: nothing can be evicted
        cache.alloc(1)
    cache.unlock(held.node)
    held = cache.lookup(np.array([1, 2, 3, 9]), max_tokens=2)  # a hit inside the edge locks its two tokens only
    assert cache.num_evictable_tokens == 4
    with pytest.raises(KVPoolFullError):
        cache.alloc(7)  # more than eviction could give: the cache keeps its entries
    assert cache.num_cached_tokens == 6
    assert cache.alloc(4).numel() == 4 and cache.num_cached_tokens == 2  # the unread rest went
    cache.unlock(held.node)
    assert not hasattr(pool, "reclaim")  # the pool never calls up into the cache: it has no hook to do so
    pool.free(slots)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_never_frees_a_locked_slot_and_leaks_nothing(seed: int) -> None:
    """A model check: requests over a four-token alphabet (much sharing) look up, lock, allocate with eviction,
    write, insert in chunks and finish in random order; every slot a live request reads must still hold what its
    tokens wrote, and the pool is whole once every request ended and the cache is cleared."""
    rng = np.random.default_rng(seed)
    pool, cache = make(48)
    content = {}  # slot -> the prefix whose last token's KV it holds
    live: list[dict] = []

    def check(req: dict) -> None:
        for j in range(req["done"]):
            s = int(req["slots"][j])
            assert not pool._is_free[s], "a slot a live request reads was freed"
            assert content[s] == tuple(req["tokens"][: j + 1]), "a slot a live request reads was overwritten"

    for _ in range(400):
        if live and rng.random() < 0.45:  # advance or finish a live request
            index = int(rng.integers(len(live)))
            req = live[index]
            end = min(req["done"] + int(rng.integers(1, 6)), len(req["tokens"]))
            for j in range(req["done"], end):
                content[int(req["slots"][j])] = tuple(req["tokens"][: j + 1])
            req["done"] = end
            node, adopted_from = cache.insert(req["tokens"][:end], req["slots"][:end])
            req["adopted"][adopted_from:end] = True
            cache.lock(node)
            cache.unlock(req["node"])
            req["node"] = node
            if end == len(req["tokens"]):
                del live[index]
                cache.unlock(req["node"])
                own = req["slots"][req["cached"] :][~req["adopted"][req["cached"] :]]
                if own.size:
                    pool.free(torch.from_numpy(np.sort(own)))
        else:  # a new request
            tokens = rng.integers(0, 4, int(rng.integers(2, 14)))
            hit = cache.lookup(tokens, len(tokens) - 1)
            try:
                own = cache.alloc(len(tokens) - hit.length).numpy()
            except KVPoolFullError:
                cache.unlock(hit.node)
                continue
            live.append({"tokens": tokens, "slots": np.concatenate([hit.slots, own]), "cached": hit.length,
                         "done": hit.length, "node": hit.node, "adopted": np.zeros(len(tokens), dtype=bool)})
        for req in live:
            check(req)
        assert cache.num_locked_tokens == cache.count_locked_tokens()
        assert pool.num_free + cache.num_cached_tokens + sum(
            int((~r["adopted"][r["cached"] :]).sum()) for r in live) == pool.num_slots
    assert cache.num_evicted_tokens > 0  # the pool ran short and the cache made room
    for req in live:
        cache.unlock(req["node"])
        own = req["slots"][req["cached"] :][~req["adopted"][req["cached"] :]]
        pool.free(torch.from_numpy(np.sort(own)))
    cache.clear()
    assert pool.num_free == pool.num_slots and cache.num_nodes == 0

"""Test helpers shared by the runtime tests: engines cached per configuration, and seeded prompts."""

from __future__ import annotations

from typing import Any

import torch

from bcg.runtime import Engine


class EngineCache:
    """Builds each engine configuration once (capture and compile are the slow part); one cache per test module,
    so a test that changes an engine's state cannot leak into another module.

    ``defaults`` apply to every engine, ``per_backend`` to one backend's; keyword arguments of a call win.
    ``"breakable"`` is the backend its name says, islands at every bucket (``full_graph_tokens=0``, which only
    changes something on CUDA, where the engine's default adds whole-step graphs); a test of those passes a size.
    """

    def __init__(self, per_backend: dict[str, dict[str, Any]] | None = None, model_for: Any = None,
                 **defaults: Any) -> None:
        self.defaults, self.per_backend = defaults, per_backend or {}
        self.model_for = model_for or (lambda preset: preset)
        self._engines: dict[tuple, Engine] = {}

    def __call__(self, preset: str, backend: str, **kw: Any) -> Engine:
        kw = {**({"full_graph_tokens": 0} if backend == "breakable" else {}), **self.defaults,
              **self.per_backend.get(backend, {}), **kw}
        key = (preset, backend, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in self._engines:
            self._engines[key] = Engine(self.model_for(preset), backend=backend, seed=0, progress=False, **kw)
        return self._engines[key]


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Seeded random prompts of the given lengths (lists of token ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def poison_scratch(eng: Engine) -> None:
    """NaN in the KV pool's scratch slot: padded rows write it and no request may read it, so no answer may see it."""
    for cache in (*eng.kv_pool.k, *eng.kv_pool.v):
        cache[eng.kv_pool.scratch_slot] = float("nan")


def same_answer(got: Any, want: Any, tol: float) -> None:
    """Logits within ``tol`` and the same greedy tokens."""
    assert (got.logits - want.logits).abs().max().item() <= tol
    assert torch.equal(got.next_tokens, want.next_tokens)


def check_prefix_hits(eng: Engine, ref: Engine, tol: float) -> None:
    """Served requests against ``ref``'s lone prefills: a shared 40-token system prompt cut at different tokens (hits
    end anywhere) and an exact repeat (all of it cached: its last token runs again as a one-token request after a
    prefix), with NaN in the scratch slot; every forward replays a graph."""
    gen = torch.Generator().manual_seed(1)
    head = torch.randint(0, eng.model.config.vocab_size, (40,), generator=gen).tolist()
    prompts = [head + [7, 8, 9], head[:33] + [4], head[:20] + list(range(1, 12)), head + [7, 8, 9]]
    poison_scratch(eng)
    results = [eng.submit(p).result(timeout=120) for p in prompts]
    for p, res in zip(prompts, results):
        same_answer(res, ref.prefill([p]), tol)
    assert results[1].cached_tokens > 0 and results[3].cached_tokens == len(prompts[3]) - 1
    batches = [b for res in results for b in res.batches]
    assert all(b.graph_used for b in batches), [b.reason for b in batches]


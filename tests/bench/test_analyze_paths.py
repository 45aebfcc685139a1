"""The real replay paths measured on toy engines (:mod:`bcg.bench.paths`): one layer's cost and the per-forward cost
beyond eager come back for each backend asked, from the same code a replay runs (tiny-dense, CPU emulation: the
numbers are the emulation's, only their shape and the cache are checked)."""

from __future__ import annotations

import math

import torch

from bcg.bench.paths import measure_paths


def test_breakables_replay_path_is_measured_once_per_process() -> None:
    paths = measure_paths("cpu", ("breakable",), cache=False)
    assert set(paths.per_layer_us) == set(paths.fixed_us) == {"breakable"} and paths.errors == {}
    assert paths.per_layer_us["breakable"] >= 0 and paths.fixed_us["breakable"] >= 0 and paths.island_us >= 0
    # What is left of a layer beyond its island, clamped at 0: the slope between two toys' host times is noise on a
    # loaded machine (a CI run measured -520 µs once), so its sign is not asserted, only what is made of it.
    total = paths.layer_total_us["breakable"]
    assert math.isfinite(total) and paths.per_layer_us["breakable"] == max(total - paths.island_us, 0.0)
    assert paths.params_per_layer > 0  # a dense layer's norms and projections
    assert paths.seconds > 0
    again = measure_paths("cpu", ("breakable",))  # the cache=False call filled the cache
    assert again.seconds == 0.0 and again.per_layer_us == paths.per_layer_us


def test_the_toys_islands_are_subtracted_at_their_back_to_back_cost(monkeypatch) -> None:
    """What the paths subtract per layer is the island as the model adds it back: a repeatable island at its
    back-to-back cost (here fixed at 7 µs a call), not its in-forward time (inflated here by 5 ms a call)."""
    import time

    from bcg.bench import paths as paths_mod
    from bcg.bench import profile

    monkeypatch.setattr(profile, "_steady_us", lambda fn, args, kwargs, repeats: (7.0, 6.0, 8.0))
    real = profile.IslandTimer.__call__

    def slow(self, fn, name, args, kwargs):  # an in-forward call far costlier than the back-to-back one
        time.sleep(0.005)
        return real(self, fn, name, args, kwargs)

    monkeypatch.setattr(profile.IslandTimer, "__call__", slow)
    monkeypatch.setattr(paths_mod, "REPS", 2)
    out = measure_paths("cpu", (), cache=False)
    assert out.island_us == 7.0  # one attention island a layer, 7 µs: the slope between the toy's layer counts


def test_a_paths_fixed_cost_is_its_one_layer_forward_less_a_layer_and_its_load(monkeypatch) -> None:
    """Per backend: a layer is the slope between the toy's layer counts, less the eager toy's island; the fixed cost
    is the 1-layer forward less that slope and less the batch's load (which the programs count apart)."""
    from bcg.bench import paths as paths_mod

    monkeypatch.setattr(paths_mod, "LAYERS", (1, 3))
    # the eager toys: islands of one forward and parameter tensors at 1 and 3 layers
    monkeypatch.setattr(paths_mod, "_eager", lambda device: ([20.0, 60.0], [9, 21]))
    table = {"breakable": ((150.0, 250.0), 30.0), "full": ((80.0, 84.0), 25.0)}  # (host at 1 and 3 layers), load
    monkeypatch.setattr(paths_mod, "_timed", lambda device, backend: table[backend])
    out = measure_paths("cpu", ("breakable", "full"), cache=False)
    assert out.island_us == 20.0 and out.params_per_layer == 6.0 and out.params_fixed == 3.0
    assert out.layer_total_us == {"breakable": 50.0, "full": 2.0}
    assert out.per_layer_us == {"breakable": 30.0, "full": 0.0}  # the island (20 us) is the model's own
    assert out.fixed_us == {"breakable": 150.0 - 50.0 - 30.0, "full": 80.0 - 2.0 - 25.0}


def test_the_two_layer_counts_are_timed_in_turn() -> None:
    """A drift of the host's speed while timing moves both toys alike, not the slope between them."""
    from types import SimpleNamespace

    from bcg.bench import paths

    calls: list[str] = []

    def toy(name: str) -> tuple[SimpleNamespace, None]:
        runner = SimpleNamespace(forward=lambda batch: calls.append(name))
        return SimpleNamespace(runner=runner, device=torch.device("cpu")), None

    low, high = paths._paired_host_us(toy("low"), toy("high"))
    assert calls == ["low", "high"] * (paths.REPS + 3) and low > 0 and high > 0

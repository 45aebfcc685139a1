"""What the engine's CUDA graphs are made of, node type by node type, beside what launching each costs the host.

On the H200 (round 15) launching a whole-step graph took the host 10 µs on llama-dense but 57-157 µs on the
Llama-3.2-1B and Qwen3-0.6B shapes at the same bucket (``benchmarks/device_bound.py``'s host steps), with about as
many kernels; their profiles show two device-to-device copies and a memset (copy-engine work) where llama-dense's
copies ran as kernels. CUDA launches a graph of kernels alone quickly; this checks whether the other node types are
what costs. Every ``torch.cuda.CUDAGraph`` the engine captures is made in debug mode (the CUDA graph kept after
instantiation), dumped as DOT (``cudaGraphDebugDotPrint``) and its nodes counted by type; each whole-step graph is
then replayed ``--replays`` times, the host time of the ``replay()`` call timed with the GPU idle before each, and
every node that is no kernel is named by the kernels around it.

Usage::

    python benchmarks/graph_nodes.py --models llama-dense,llama-3.2-1b,qwen3-0.6b --out nodes.json

CUDA only: on a machine without a GPU it says so and exits with status 2. :func:`node_types` (the DOT parser) runs
anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from device_bound import SHAPES

from bcg.bench.results import write_json
from bcg.runtime import Engine

# A DOT node of cudaGraphDebugDotPrint: a record whose label starts with the node's type.
_NODE = re.compile(r'label="\{\s*([A-Z_]+)')


def node_types(dot: str) -> Counter:
    """Node types of one graph's DOT dump, counted (``KERNEL``, ``MEMCPY``, ``MEMSET``, ...).

    Example:
        >>> node_types('"n0"[shape="record" label="{KERNEL | {ID | 0}}"]; "n1"[label="{MEMSET | {ID | 1}}"]')
        Counter({'KERNEL': 1, 'MEMSET': 1})
    """
    return Counter(_NODE.findall(dot))


_RECORD = re.compile(r'"(graph_\d+_node_\d+)"\[')
_EDGE = re.compile(r'"(graph_\d+_node_\d+)"\s*->\s*"(graph_\d+_node_\d+)"')
_KERNEL_NAME = re.compile(r"topoId: \d+\)\s*\|\s*([^\s|}\\]+)")


def non_kernel_nodes(dot: str) -> list[dict[str, Any]]:
    """Each node of a DOT dump that is no kernel, with the kernels right before and after it (by the graph's
    edges): which op of the forward put a copy or a memset into the graph.

    Example:
        >>> dot = ('"graph_1_node_0"[label="{KERNEL\\n| {ID | 0 (topoId: 2) | add_kernel}}"];'
        ...        '"graph_1_node_1"[label="{\\nMEMSET\\n| {ID | 1}}"];'
        ...        '"graph_1_node_0" -> "graph_1_node_1" [headlabel=0];')
        >>> non_kernel_nodes(dot)
        [{'type': 'MEMSET', 'after': ['add_kernel'], 'before': []}]
    """
    starts = [(m.start(), m.group(1)) for m in _RECORD.finditer(dot)]
    kinds, names = {}, {}
    for (start, node), (end, _) in zip(starts, [*starts[1:], (len(dot), "")]):
        text = dot[start:end]
        kind = _NODE.search(text)
        kinds[node] = kind.group(1) if kind else "?"
        name = _KERNEL_NAME.search(text)
        names[node] = name.group(1)[:80] if name else kinds[node]
    edges = _EDGE.findall(dot)
    return [{"type": kinds[n], "after": [names[a] for a, b in edges if b == n],
             "before": [names[b] for a, b in edges if a == n]}
            for n in kinds if kinds[n] != "KERNEL"]


class _Recorder:
    """Every ``torch.cuda.CUDAGraph`` made while installed, kept and in debug mode (so it can be dumped after capture).

    Debug mode alone is not enough: since ``keep_graph`` exists, ``capture_end`` of a graph made without it destroys
    the CUDA graph after instantiating it whatever the debug flag says, and ``debug_dump`` then writes nothing (the
    H200's first run of this script, torch 2.11). A kept graph is instantiated by its first ``replay()``.
    """

    def __init__(self) -> None:
        self.graphs: list[Any] = []
        self._original = torch.cuda.CUDAGraph

    def __enter__(self) -> _Recorder:
        graphs, original = self.graphs, self._original

        class DebugGraph(original):  # type: ignore[misc, valid-type]
            # pybind11 builds the C++ graph in __init__ with the call's arguments (torch's __new__ only allocates),
            # so keep_graph must reach __init__: passing it to __new__ alone left every graph unkept.
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                if not args and "keep_graph" not in kwargs:
                    args = (True,)  # keep_graph, positionally: the binding's argument name is not promised
                try:
                    super().__init__(*args, **kwargs)
                except TypeError:  # a torch before keep_graph: debug mode alone kept the graph there
                    super().__init__()
                self.enable_debug_mode()
                graphs.append(self)

        torch.cuda.CUDAGraph = DebugGraph  # type: ignore[misc]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.CUDAGraph = self._original  # type: ignore[misc]


def dump(graph: Any, folder: Path) -> str:
    path = folder / f"g{id(graph)}.dot"
    graph.debug_dump(str(path))
    if not path.exists():
        raise RuntimeError(f"debug_dump wrote no {path.name}: the graph was not kept after capture (keep_graph)")
    return path.read_text()


def replay_us(eng: Engine, bucket: int, graph: Any, replays: int) -> float:
    """Median host time of ``graph.replay()`` with the GPU idle before each call.

    A prefill of ``bucket`` tokens runs first, so the graph's static inputs hold a batch it was made for: a bare
    replay reads whatever the last batch left there (the H200 run that did so gathered out of bounds)."""
    eng.prefill([torch.randint(0, eng.model.config.vocab_size, (bucket,)).tolist()])
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        graph.replay()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def measure(name: str, replays: int, folder: Path, dots: Path | None = None) -> dict[str, Any]:
    with _Recorder() as rec:
        eng = Engine(SHAPES.get(name, name), progress=False)
    try:
        full = eng.runner.full
        whole = {bucket: g for bucket, g in (full.handles.items() if full is not None else [])}
        by_id = {id(g) for g in whole.values()}
        rows = []
        for bucket, g in sorted(whole.items()):
            dot = dump(g, folder)
            if dots is not None and bucket in (min(whole), max(whole)):  # the raw dump, to re-read by hand
                dots.mkdir(parents=True, exist_ok=True)
                (dots / f"{name}-{bucket}.dot").write_text(dot)
            rows.append({"bucket": bucket, "nodes": dict(node_types(dot)),
                         "replay_us": replay_us(eng, bucket, g, replays), "non_kernel": non_kernel_nodes(dot)})
        others: Counter = Counter()
        for g in rec.graphs:
            if id(g) not in by_id:
                try:
                    others += node_types(dump(g, folder))
                except (RuntimeError, OSError):  # made but never captured (an anchor, a refused bucket): no dump
                    pass
        return {"model": name, "whole_step": rows, "other_graphs": dict(others)}
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-dense,llama-3.2-1b,qwen3-0.6b")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--dots", type=Path, default=None,
                        help="also write the DOT dumps of the smallest and largest whole-step graphs here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/graph_nodes.py needs a CUDA GPU; none found.")
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                r = measure(name, args.replays, Path(tmp), args.dots)
            except Exception as exc:  # one model's failure must not cost the others' census
                traceback.print_exc()
                results.append({"model": name, "error": repr(exc)[:300]})
                continue
            results.append(r)
            print(f"\n{name}: breakable segments {r['other_graphs']}")
            print(f"  {'bucket':>6} {'replay us':>9}  nodes")
            for row in r["whole_step"]:
                print(f"  {row['bucket']:>6} {row['replay_us']:>9.1f}  {row['nodes']}", flush=True)
                for node in row["non_kernel"][:6]:
                    print(f"         {node['type']} after {node['after']} before {node['before']}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if args.out:
        write_json(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

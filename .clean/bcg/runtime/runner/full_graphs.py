"""Two graphs per small bucket (``EngineConfig.full_graph_tokens``): the config of a breakable runner's whole-step
graphs, and how their build shows in its telemetry. The runner that holds them tries them first (``Runner.forward``)."""

from __future__ import annotations

from dataclasses import replace

from bcg.ops.attention import StaticTritonAttention
from bcg.runtime.config import EngineConfig, describe_buckets
from bcg.runtime.runner.telemetry import Telemetry

__all__ = ["FULL_FALLBACK", "adopt_full_graphs", "full_graph_config"]

FULL_FALLBACK = "the breakable graphs serve every batch"  # what a refused whole-step runner leaves in charge


def full_graph_config(config: EngineConfig, buckets: list[int]) -> EngineConfig:
    """The config of a breakable runner's whole-step graphs: backend "full" on ``buckets``, with bcg's Triton varlen
    kernel reading the KV pool in place where it runs, else the static attention.

    Example::

        full_graph_config(EngineConfig(device="cpu", dtype="bfloat16"), [16, 32]).attention_backend  # 'static_triton'
    """
    usable = StaticTritonAttention.is_usable(config.torch_device, config.torch_dtype) is None
    return replace(config, backend="full", attention_backend="static_triton" if usable else "static",
                   full_graph_tokens=0, buckets=buckets, max_tokens=max(buckets), verify=False)


def adopt_full_graphs(telemetry: Telemetry, full: Telemetry, buckets: list[int]) -> None:
    """Adds the whole-step graphs' build (time, graph memory) to the breakable runner's ``telemetry``, with a note
    saying what they hold and whether they were refused."""
    telemetry.capture_ms += full.capture_ms
    telemetry.graph_memory_bytes += full.graph_memory_bytes
    telemetry.notes.append(
        f"full graphs: {full.num_captured} of buckets {describe_buckets(buckets)} also hold the whole step with "
        f"{full.attention_backend} attention inside, replayed by the batches that fit ({full.capture_ms:.0f} ms, "
        f"{full.graph_memory_bytes / 2**20:.0f} MiB)" + (f"; refused: {full.refused_reason}" if full.refused_reason
                                                         else ""))

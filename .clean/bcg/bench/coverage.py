"""Bucket coverage: which forwards of a workload a bucket ladder replays, and the smallest ceiling that covers them.

Pure arithmetic over prompt lengths and a replay-or-eager predicate, unit-tested without a model or a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["Coverage", "bucket_coverage", "chunk_sizes", "smallest_covering_ceiling"]

Choose = Callable[[int], tuple[int | None, str]]


def chunk_sizes(length: int, chunked_prefill_size: int) -> list[int]:
    """Forward sizes of one prompt prefilled alone: full chunks, then the remainder (as the scheduler splits).

    Example::

        >>> chunk_sizes(5000, 2048)
        [2048, 2048, 904]
    """
    if length < 1 or chunked_prefill_size < 1:
        raise ValueError(f"length and chunked_prefill_size must be >= 1, got {length}, {chunked_prefill_size}")
    full, rest = divmod(length, chunked_prefill_size)
    return [chunked_prefill_size] * full + ([rest] if rest else [])


@dataclass
class Coverage:
    """How a bucket ladder serves a prompt-length distribution (each prompt prefilled alone, chunked).

    Attributes:
        num_prompts / num_forwards: prompts given and the forwards they split into.
        graph_fraction: share of forwards that replay a graph.
        graph_token_fraction: share of real tokens that go through a replayed graph.
        padding_waste: (padded - real) / real over the forwards that replay a graph.
        reaches_chunk: whether the largest bucket is at least ``chunked_prefill_size``.
        never_fired: buckets no forward of the distribution chose.
        fired: forwards per bucket.
        eager_reasons: forwards per reason for running eagerly.
        forward_sizes: the real size of every forward (for histograms).
    """

    num_prompts: int
    num_forwards: int
    graph_fraction: float
    graph_token_fraction: float
    padding_waste: float
    reaches_chunk: bool
    max_bucket: int
    chunked_prefill_size: int
    never_fired: list[int]
    fired: dict[int, int] = field(default_factory=dict)
    eager_reasons: dict[str, int] = field(default_factory=dict)
    forward_sizes: list[int] = field(default_factory=list, repr=False)


def bucket_coverage(lengths: Iterable[int], choose: Choose, buckets: Sequence[int],
                    chunked_prefill_size: int) -> Coverage:
    """Coverage of ``lengths`` by ``buckets``, deciding replay with ``choose`` (pass ``runner.choose``).

    Using the runner's own predicate means disabled buckets and the padding limit count exactly as they will
    at serving time.

    Example::

        >>> from bcg.runtime.runner.buckets import BucketTable
        >>> table = BucketTable([16, 32, 64])
        >>> choose = lambda n: (table.choose(n).bucket, table.choose(n).reason)
        >>> cov = bucket_coverage([10, 30, 100], choose, table.sizes, chunked_prefill_size=128)
        >>> cov.graph_fraction, cov.never_fired, cov.reaches_chunk
        (0.6666666666666666, [64], False)
    """
    if not buckets:
        raise ValueError("bucket_coverage needs at least one bucket")
    lengths = list(lengths)
    if not lengths:
        raise ValueError("bucket_coverage needs at least one prompt length")
    fired: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    sizes: list[int] = []
    real_graph = padded_graph = real_total = 0
    for length in lengths:
        for n in chunk_sizes(int(length), chunked_prefill_size):
            sizes.append(n)
            real_total += n
            bucket, reason = choose(n)
            if bucket is None:
                reasons[reason] += 1
                continue
            fired[bucket] += 1
            real_graph += n
            padded_graph += bucket
    num_forwards = len(sizes)
    graph_forwards = sum(fired.values())
    return Coverage(
        num_prompts=len(lengths),
        num_forwards=num_forwards,
        graph_fraction=graph_forwards / num_forwards,
        graph_token_fraction=real_graph / real_total,
        padding_waste=(padded_graph - real_graph) / real_graph if real_graph else 0.0,
        reaches_chunk=max(buckets) >= chunked_prefill_size,
        max_bucket=max(buckets),
        chunked_prefill_size=chunked_prefill_size,
        never_fired=sorted(b for b in set(buckets) if b not in fired),
        fired=dict(sorted(fired.items())),
        eager_reasons=dict(reasons),
        forward_sizes=sizes,
    )


def smallest_covering_ceiling(forward_sizes: Iterable[int], ladder: Sequence[int],
                              chunked_prefill_size: int) -> int:
    """The smallest ladder size that covers every forward, capped at ``chunked_prefill_size``.

    No forward is larger than the chunk, so a ceiling above it only adds resident memory; a ceiling below the
    largest forward leaves that forward's eager activation peak in place (the seed's memory lesson).

    Example::

        >>> smallest_covering_ceiling([100, 300], [128, 256, 512, 1024], 2048)
        512
    """
    largest = max(forward_sizes)
    for size in sorted(ladder):
        if size >= largest:
            return min(size, chunked_prefill_size)
    return chunked_prefill_size

"""Cross-rank agreement of a tensor parallel runner: every rank takes the same decision for every bucket and batch.

Every rank runs the same graphs, and a collective inside one waits for every rank, so a rank that replays while
another runs eagerly (or captures a different graph) deadlocks or computes garbage. Nothing is assumed equal: each
decision is exchanged over the host (gloo) group, small int64 CPU tensors that never wait for the device.

* Build: a backend refused on one rank is refused on all, and a layer stack that does not compile on one rank
  runs uncompiled on all. Each bucket's capture is bracketed by a phase protocol:
  the barrier before every island (``barrier_fn``) and the end of the capture are the same all-reduce of
  ``[phase, failed]``, so a rank that fails mid-capture (and skips its remaining barriers) meets its peers'
  next barrier with ``END`` and they abort too, instead of waiting for barriers that never come. Then every rank
  shares ``[status, segments, breaks]``: the bucket is kept only if every rank captured the same graph.
* Prefill: before anything else, the ranks compare what they were given (the number of prompts, of tokens, and a
  checksum of every id): ranks handed different prompts would each compute garbage or, with different lengths,
  wait in collectives of different sizes; every rank raises :class:`~bcg.ops.parallel.TensorParallelError` instead.
* Forward: the chosen bucket (0 for eager) is all-reduced as ``max`` and ``-min``; if ranks differ, all run
  eagerly ("ranks_disagree"). After a replay one all-reduce tells every rank whether any replay raised; then every
  rank reruns the batch eagerly and disables the bucket.

Every exchange is bounded by the group's timeout and fails as :class:`~bcg.ops.parallel.TensorParallelError`.
"""

from __future__ import annotations

import logging
import zlib

import numpy as np
import torch
import torch.distributed as dist

from bcg.ops.parallel import TensorParallel, TensorParallelError
from bcg.runtime.backends import BackendRefused

__all__ = ["PeerFailure", "RankAgreement", "capture_verdict"]

logger = logging.getLogger("bcg")

_BARRIER, _END = 0, 1
_OK, _FAILED, _REFUSED = 0, 1, 2


class PeerFailure(RuntimeError):
    """Another rank failed (a capture or a replay), so this rank drops the same graph."""


def capture_verdict(rank: int, bucket: int, error: BaseException | None, rows: list[list[int]]) -> BaseException | None:
    """What this rank does with a captured bucket, given every rank's ``[status, segments, breaks]``.

    Returns None (keep it) or the error to handle as this rank's own failure: a refusal anywhere refuses the
    backend everywhere (:class:`BackendRefused`), any other failure disables the bucket, and so do graphs that
    differ between ranks.

    Example:
        >>> capture_verdict(0, 16, None, [[0, 3, 2], [0, 3, 2]]) is None
        True
        >>> capture_verdict(0, 16, None, [[0, 3, 2], [1, -1, -1]])
        PeerFailure('bucket 16: the capture failed on rank 1 (see its log)')
        >>> capture_verdict(0, 16, None, [[0, 3, 2], [0, 4, 3]])
        PeerFailure('bucket 16: the ranks captured different graphs (segments, breaks): rank 0 (3, 2), rank 1 (4, 3)')
    """
    refused = [r for r, row in enumerate(rows) if row[0] == _REFUSED]
    if refused and rows[rank][0] != _REFUSED:
        return BackendRefused(f"tensor parallel rank {refused[0]} cannot capture this model (see its log)")
    if error is not None:
        return error
    failed = [r for r, row in enumerate(rows) if row[0] != _OK]
    if failed:
        return PeerFailure(f"bucket {bucket}: the capture failed on rank {', '.join(map(str, failed))} (see its log)")
    shapes = [tuple(row[1:]) for row in rows]
    if len(set(shapes)) > 1:
        listed = ", ".join(f"rank {r} ({s}, {b})" for r, (s, b) in enumerate(shapes))
        return PeerFailure(f"bucket {bucket}: the ranks captured different graphs (segments, breaks): {listed}")
    return None


class RankAgreement:
    """The exchanges of one tensor parallel runner over ``tp.host_group`` (see the module docstring).

    Example::

        agreement = RankAgreement(tp)
        bucket, reason = agreement.agree_choice(*runner.choose(n, batch))   # the same on every rank
    """

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self._bucket: int | None = None
        self._peer_ended = False

    def _all_reduce_max(self, values: list[int], what: str) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp.host_group)
        except RuntimeError as e:
            raise self.tp.peer_error(f"agreeing on {what}", e) from e
        return t.tolist()

    def agree_min(self, value: int, what: str) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV pool size every rank can allocate)."""
        return -self._all_reduce_max([-value], what)[0]

    def _all_gather(self, values: list[int], what: str) -> list[list[int]]:
        t = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.tp.size)]
        try:
            dist.all_gather(parts, t, group=self.tp.host_group)
        except RuntimeError as e:
            raise self.tp.peer_error(f"agreeing on {what}", e) from e
        return [p.tolist() for p in parts]

    # ---------------------------------------------------------------- build
    def agree_outcome(self, error: BaseException | None, what: str) -> BaseException | None:
        """After a build step every rank takes (``what``): this rank's error, or a :class:`PeerFailure` naming the
        rank where it failed, so every rank falls back the same way."""
        rows = self._all_gather([int(error is not None)], what)
        failed = [r for r, (flag,) in enumerate(rows) if flag]
        if error is None and failed:
            return PeerFailure(f"{what} failed on tensor parallel rank {failed[0]} (see its log)")
        return error

    def begin_capture(self, bucket: int) -> None:
        """A capture of ``bucket`` starts: its exchanges begin."""
        self._bucket, self._peer_ended = bucket, False

    def capture_barrier(self) -> None:
        """``barrier_fn`` of breakable captures: aligns the ranks before each island, and aborts this capture if a
        peer ended it (a failure there, or fewer breaks)."""
        phase, _ = self._all_reduce_max([_BARRIER, 0], f"the capture of bucket {self._bucket}")
        if phase == _END:
            self._peer_ended = True
            raise PeerFailure(f"bucket {self._bucket}: another rank ended this capture early (it failed there or "
                              "captured fewer breaks)")

    def agree_capture(self, bucket: int, error: BaseException | None, refused: bool,
                      shape: tuple[int, int] | None) -> BaseException | None:
        """After ``bucket``'s capture: None when every rank captured the same graph, else the error to handle.

        Args:
            error: this rank's capture error, if any; refused: whether it refuses the whole backend.
            shape: ``(segments, breaks)`` of this rank's graph (None when the capture failed).
        """
        if not self._peer_ended:
            self._all_reduce_max([_END, int(error is not None)], f"the end of the capture of bucket {bucket}")
        status = _OK if error is None else (_REFUSED if refused else _FAILED)
        segments, breaks = shape if shape is not None else (-1, -1)
        rows = self._all_gather([status, segments, breaks], f"the graph of bucket {bucket}")
        verdict = capture_verdict(self.tp.rank, bucket, error, rows)
        if verdict is not None and verdict is not error:
            logger.warning("bcg: tensor parallel rank %d drops bucket %d: %s", self.tp.rank, bucket, verdict)
        return verdict

    def agree_buckets(self, disabled: list[bool], what: str) -> list[bool]:
        """Which buckets (by position) are disabled on some rank, given this rank's flags."""
        return [bool(v) for v in self._all_reduce_max([int(d) for d in disabled], f"the buckets after {what}")]

    # ---------------------------------------------------------------- forward
    def agree_prompts(self, ids: list[torch.Tensor]) -> None:
        """Every rank was given the same prompts (their count, their lengths' sum and a CRC-32 of every id, in one
        exchange), or every rank raises :class:`TensorParallelError` naming what differs."""
        every = np.concatenate([t.numpy() for t in ids]) if len(ids) > 1 else ids[0].numpy()
        mine = [len(ids), int(every.size), zlib.crc32(np.ascontiguousarray(every).view(np.uint8))]
        rows = self._all_gather(mine, "the prompts of a prefill")
        if all(row == rows[0] for row in rows):
            return
        listed = "; ".join(f"rank {r}: {n} prompt(s), {t} tokens, checksum {c:08x}" for r, (n, t, c) in enumerate(rows))
        raise TensorParallelError(
            f"tensor parallel ranks were given different prompts ({listed}). Every rank of a group must call "
            "prefill with the same prompts in the same order (broadcast them from rank 0); nothing was run")

    def agree_choice(self, bucket: int | None, reason: str) -> tuple[int | None, str]:
        """The bucket every rank replays (the one each chose), or eager on all when they differ."""
        code = bucket or 0
        high, neg_low = self._all_reduce_max([code, -code], "the bucket of a batch")
        if high == -neg_low:
            return bucket, reason
        logger.warning("bcg: tensor parallel ranks chose different buckets for a batch (from %d to %d, 0 is eager); "
                       "every rank runs it eagerly", -neg_low, high)
        return None, "ranks_disagree"

    def agree_replay(self, bucket: int, error: BaseException | None) -> BaseException | None:
        """After a replay: this rank's error, a :class:`PeerFailure` if another rank's replay raised, else None."""
        failed, lowest = self._all_reduce_max([int(error is not None), self.tp.size - self.tp.rank if error else 0],
                                              f"the replay of bucket {bucket}")
        if error is None and failed:
            return PeerFailure(f"the replay of bucket {bucket} failed on rank {self.tp.size - lowest}")
        return error

"""The capture verdict of tensor parallel ranks: what each rank does with a bucket, from every rank's report.

The exchanges themselves run between real rank processes in tests/runtime/test_tensor_parallel.py and
test_tensor_parallel_failures.py.
"""

from __future__ import annotations

import pytest

from bcg.runtime.backends import BackendRefused
from bcg.runtime.runner.agreement import PeerFailure, capture_verdict

OK, FAILED, REFUSED = 0, 1, 2


def test_the_same_graph_on_every_rank_is_kept():
    assert capture_verdict(1, 32, None, [[OK, 25, 24]] * 4) is None


def test_a_rank_keeps_its_own_error():
    own = RuntimeError("out of memory")
    assert capture_verdict(0, 32, own, [[FAILED, -1, -1], [OK, 25, 24]]) is own


@pytest.mark.parametrize("rank", [0, 2])
def test_a_failure_elsewhere_drops_the_bucket_and_names_the_ranks(rank):
    rows = [[OK, 25, 24], [FAILED, -1, -1], [OK, 25, 24], [FAILED, -1, -1]]
    verdict = capture_verdict(rank, 32, None, rows)
    assert isinstance(verdict, PeerFailure) and not isinstance(verdict, BackendRefused)
    assert "bucket 32" in str(verdict) and "rank 1, 3" in str(verdict)


def test_a_refusal_anywhere_refuses_the_backend_everywhere():
    rows = [[FAILED, -1, -1], [REFUSED, -1, -1]]
    verdict = capture_verdict(0, 32, RuntimeError("peer ended the capture"), rows)
    assert isinstance(verdict, BackendRefused) and "rank 1 cannot capture this model" in str(verdict)
    own = BackendRefused("uncapturable op")
    assert capture_verdict(1, 32, own, rows) is own


def test_graphs_that_differ_between_ranks_are_dropped():
    verdict = capture_verdict(0, 8, None, [[OK, 25, 24], [OK, 26, 24]])
    assert isinstance(verdict, PeerFailure)
    assert "different graphs" in str(verdict) and "rank 0 (25, 24), rank 1 (26, 24)" in str(verdict)

"""Side-stream fork/join tracking, with fake stream keys so it runs without a GPU."""

from __future__ import annotations

import pytest
import torch

import bcg
from bcg import streams
from bcg.capture import _CaptureState
from bcg.streams import StreamTracker

CAP = "capture"


class FakeStream:
    """Has what the tracker and the capture state use: a ``cuda_stream`` key and ``wait_stream``."""

    def __init__(self, key: int, log: list | None = None) -> None:
        self.cuda_stream = key
        self.log = log if log is not None else []

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.cuda_stream, other.cuda_stream))

    def __repr__(self) -> str:
        return f"FakeStream({self.cuda_stream:#x})"


def _fork(t: StreamTracker, side_key, side, event: int, source=CAP) -> None:
    t.on_record(event, source)
    t.on_wait(side_key, side, event)


def _join(t: StreamTracker, side_key, event: int) -> None:
    t.on_record(event, side_key)
    t.on_wait(CAP, "capture-stream-object", event)


# ----------------------------------------------------------------------------------------------------------------
# StreamTracker


def test_nothing_forked_at_start():
    t = StreamTracker(CAP)
    assert t.unjoined() == [] and not t.forked


def test_waiting_on_a_capture_stream_event_forks():
    t = StreamTracker(CAP)
    _fork(t, "s1", "S1", event=1)
    assert t.unjoined() == ["S1"]


def test_capture_stream_waiting_on_the_side_stream_joins():
    t = StreamTracker(CAP)
    _fork(t, "s1", "S1", event=1)
    _join(t, "s1", event=2)
    assert t.unjoined() == []


def test_waiting_on_an_event_recorded_before_the_capture_is_ignored():
    t = StreamTracker(CAP)
    t.on_wait("s1", "S1", 99)  # the event was never recorded while tracking
    assert t.unjoined() == []


def test_events_of_unrelated_streams_are_ignored():
    t = StreamTracker(CAP)
    t.on_record(5, "outside")  # a stream that is not part of the capture
    t.on_wait("s1", "S1", 5)
    assert t.unjoined() == []
    t.on_record(6, "s2")
    t.on_wait(CAP, "C", 6)  # the capture stream waiting on an unrelated stream joins nothing
    assert t.unjoined() == []


def test_capture_stream_waiting_on_itself_is_not_a_fork():
    t = StreamTracker(CAP)
    t.on_record(1, CAP)
    t.on_wait(CAP, "C", 1)
    assert t.unjoined() == []


def test_a_stream_forked_from_a_forked_stream_is_tracked_too():
    t = StreamTracker(CAP)
    _fork(t, "s1", "S1", event=1)
    _fork(t, "s2", "S2", event=2, source="s1")
    assert t.unjoined() == ["S1", "S2"]
    _join(t, "s1", event=3)
    assert t.unjoined() == ["S2"]  # joining s1 does not join s2
    _join(t, "s2", event=4)
    assert t.unjoined() == []


def test_forking_twice_keeps_one_entry():
    t = StreamTracker(CAP)
    _fork(t, "s1", "S1", event=1)
    _fork(t, "s1", "S1-again", event=2)
    assert t.unjoined() == ["S1"]


def test_join_before_record_of_the_fork_is_ignored():
    t = StreamTracker(CAP)
    t.on_record(1, "s1")  # s1 is not forked: its event is unrelated
    t.on_wait(CAP, "C", 1)
    _fork(t, "s1", "S1", event=2)
    assert t.unjoined() == ["S1"]


def test_reset_forgets_forks_and_events():
    t = StreamTracker(CAP)
    _fork(t, "s1", "S1", event=1)
    t.on_record(2, CAP)
    t.reset()
    assert t.unjoined() == []
    t.on_wait("s2", "S2", 2)  # the event was recorded before the reset: unknown now
    assert t.unjoined() == []


# ----------------------------------------------------------------------------------------------------------------
# the hooks feed the active tracker


class FakeEvent:
    pass


def test_hooked_record_and_waits_report_to_the_active_tracker():
    calls = []
    record = streams._hooked_record(lambda ev, s: calls.append(("record", s.cuda_stream)))
    stream_wait_event = streams._hooked_stream_wait_event(lambda s, ev: calls.append(("stream_wait", s.cuda_stream)))
    event_wait = streams._hooked_event_wait(lambda ev, s: calls.append(("event_wait", s.cuda_stream)))
    capture, side1, side2 = FakeStream(0xC), FakeStream(0x1), FakeStream(0x2)
    tracker = StreamTracker(capture.cuda_stream)
    e1, e2, e3, e4 = FakeEvent(), FakeEvent(), FakeEvent(), FakeEvent()

    token = streams.active_tracker().set(tracker)
    try:
        record(e1, capture)
        stream_wait_event(side1, e1)  # side1.wait_stream(capture)
        record(e2, capture)
        event_wait(e2, side2)  # e2.wait(side2)
        assert tracker.unjoined() == [side1, side2]
        record(e3, side1)
        stream_wait_event(capture, e3)
        record(e4, side2)
        event_wait(e4, capture)
        assert tracker.unjoined() == []
    finally:
        streams.active_tracker().reset(token)
    # the originals always run, in order
    assert [c[0] for c in calls] == ["record", "stream_wait", "record", "event_wait"] * 2

    # without an active tracker the hooks only forward
    record(FakeEvent(), side1)
    assert tracker.unjoined() == [] and calls[-1] == ("record", 0x1)


def test_install_and_remove_hooks_are_refcounted_and_restore_torch():
    originals = (torch.cuda.Event.record, torch.cuda.Event.wait, torch.cuda.Stream.wait_event)
    streams.install_hooks()
    try:
        hooked = (torch.cuda.Event.record, torch.cuda.Event.wait, torch.cuda.Stream.wait_event)
        assert all(h is not o for h, o in zip(hooked, originals))
        streams.install_hooks()  # a second capture (another thread): no double wrapping
        assert (torch.cuda.Event.record, torch.cuda.Event.wait, torch.cuda.Stream.wait_event) == hooked
        streams.remove_hooks()
        assert torch.cuda.Event.record is hooked[0]  # still in use by the first
    finally:
        streams.remove_hooks()
    assert (torch.cuda.Event.record, torch.cuda.Event.wait, torch.cuda.Stream.wait_event) == originals


# ----------------------------------------------------------------------------------------------------------------
# what a capture does with unjoined streams at a break


def _state_with_side_stream(auto_join: bool):
    log: list = []
    capture = FakeStream(0xC0, log)
    state = _CaptureState(bcg.BreakableCUDAGraph(emulate=True), None, "global", None, auto_join, None)
    state.stream, state.tracker = capture, StreamTracker(capture.cuda_stream)
    side = FakeStream(0xABC, log)
    _fork(state.tracker, side.cuda_stream, side, event=1, source=capture.cuda_stream)
    return state, side, log


def test_unjoined_side_stream_at_a_break_is_a_clear_capture_error():
    state, side, log = _state_with_side_stream(auto_join=False)
    with pytest.raises(bcg.CaptureError) as info:
        state._join_side_streams("the eager function 'attn'", force=False)
    msg = str(info.value)
    assert "0xabc" in msg and "'attn'" in msg
    assert "wait_stream(side_stream)" in msg and "auto_join_streams=True" in msg
    assert log == []  # nothing was joined behind the user's back
    assert state.tracker.unjoined() == [side]


def test_auto_join_makes_the_capture_stream_wait_on_each_side_stream():
    state, side, log = _state_with_side_stream(auto_join=True)
    state._join_side_streams("the eager function 'attn'", force=False)
    assert log == [("wait_stream", 0xC0, 0xABC)]
    assert state.tracker.unjoined() == []


def test_abort_joins_even_without_auto_join():
    state, side, log = _state_with_side_stream(auto_join=False)
    state._join_side_streams("abort", force=True)
    assert log == [("wait_stream", 0xC0, 0xABC)]


def test_no_side_streams_nothing_to_do():
    state, side, log = _state_with_side_stream(auto_join=False)
    state.tracker.reset()
    state._join_side_streams("the end of the capture", force=False)
    assert log == []


def test_joins_are_transitive_through_another_side_stream():
    t = StreamTracker(CAP)
    _fork(t, 1, "s1", event=10)
    _fork(t, 2, "s2", event=11, source=1)  # s2 forks from s1
    t.on_record(12, 2)
    t.on_wait(1, "s1", 12)  # s2 joins into s1 ...
    assert t.unjoined() == ["s1"]
    _join(t, 1, event=13)  # ... and s1 into the capture stream
    assert t.unjoined() == []

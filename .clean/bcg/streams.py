"""Side-stream fork/join tracking during a breakable capture.

A CUDA graph segment can only end when every stream forked from the capture stream has been joined back. At a
break bcg ends the segment, so an unjoined side stream there would make ``cudaStreamEndCapture`` fail (or leave the
side stream capturing). The tracker watches event records and waits, which is how streams fork and join in torch
(``Stream.wait_stream`` records an event and waits on it), and lets the capture raise a clear error, or join the
streams itself, *before* the segment ends.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["StreamTracker", "install_hooks", "remove_hooks"]


class StreamTracker:
    """Which side streams are forked from the capture stream and not yet joined (pure bookkeeping).

    Streams are identified by hashable keys (the raw ``cuda_stream`` handle on CUDA), so the logic is testable
    without a GPU.
    """

    def __init__(self, capture_key: Hashable) -> None:
        self.capture_key = capture_key
        self.forked: dict[Hashable, Any] = {}
        self._event_source: dict[int, Hashable] = {}

    def reset(self) -> None:
        """Forget everything: a new segment starts with no side stream in its capture."""
        self.forked.clear()
        self._event_source.clear()

    def on_record(self, event_key: int, stream_key: Hashable) -> None:
        self._event_source[event_key] = stream_key

    def on_wait(self, waiter_key: Hashable, waiter: Any, event_key: int) -> None:
        source = self._event_source.get(event_key)
        if source is None:
            return  # an event recorded outside the capture: no fork or join
        waiter_in_capture = waiter_key == self.capture_key or waiter_key in self.forked
        if source in self.forked and waiter_in_capture:
            # Joined into a stream of the capture; joins are transitive (s2 -> s1 -> capture stream).
            self.forked.pop(source)
        elif (source == self.capture_key or source in self.forked) and not waiter_in_capture:
            self.forked[waiter_key] = waiter  # fork

    def unjoined(self) -> list[Any]:
        return list(self.forked.values())


_ACTIVE: contextvars.ContextVar[StreamTracker | None] = contextvars.ContextVar("bcg_stream_tracker", default=None)
_lock = threading.Lock()
_users = 0
_saved: dict[str, Callable] = {}


def active_tracker() -> contextvars.ContextVar[StreamTracker | None]:
    """The context variable holding the tracker of the capture running in this context."""
    return _ACTIVE


def _hooked_record(original: Callable) -> Callable:
    def record(self: torch.cuda.Event, stream: torch.cuda.Stream | None = None) -> Any:
        tracker = _ACTIVE.get()
        if tracker is not None:
            s = stream if stream is not None else torch.cuda.current_stream()
            tracker.on_record(id(self), s.cuda_stream)
        return original(self, stream)

    return record


def _hooked_stream_wait_event(original: Callable) -> Callable:
    def wait_event(self: torch.cuda.Stream, event: torch.cuda.Event) -> Any:
        tracker = _ACTIVE.get()
        if tracker is not None:
            tracker.on_wait(self.cuda_stream, self, id(event))
        return original(self, event)

    return wait_event


def _hooked_event_wait(original: Callable) -> Callable:
    def wait(self: torch.cuda.Event, stream: torch.cuda.Stream | None = None) -> Any:
        tracker = _ACTIVE.get()
        if tracker is not None:
            s = stream if stream is not None else torch.cuda.current_stream()
            tracker.on_wait(s.cuda_stream, s, id(self))
        return original(self, stream)

    return wait


def install_hooks() -> None:
    """Wraps torch's event record/wait entry points (refcounted; only while a CUDA capture runs)."""
    global _users
    with _lock:
        if _users == 0:
            _saved["record"] = torch.cuda.Event.record
            _saved["event_wait"] = torch.cuda.Event.wait
            _saved["stream_wait_event"] = torch.cuda.Stream.wait_event
            torch.cuda.Event.record = _hooked_record(_saved["record"])
            torch.cuda.Event.wait = _hooked_event_wait(_saved["event_wait"])
            torch.cuda.Stream.wait_event = _hooked_stream_wait_event(_saved["stream_wait_event"])
        _users += 1


def remove_hooks() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            torch.cuda.Event.record = _saved.pop("record")
            torch.cuda.Event.wait = _saved.pop("event_wait")
            torch.cuda.Stream.wait_event = _saved.pop("stream_wait_event")

"""A forward's metadata on its way to the device: named integer fields, one host buffer, one copy.

Everything between a call to ``prefill`` and the first kernel leaves the GPU idle, and a graph reads its inputs
from fixed addresses. So every piece of a forward's metadata (the runner's token ids and positions, the attention
backend's KV slots and cumulative lengths) is a named field of one :class:`Layout`: the host writes the fields
with numpy into one host buffer and :meth:`Staged.upload` moves them in one non-blocking copy. A layout made for
a captured bucket (:meth:`MetadataArena.layout`) puts its fields at fixed offsets of the arena's device buffer,
so the graphs captured against its views read every later batch staged into it; every bucket's layout starts at
offset 0, because one runner replays one bucket at a time and the copy is ordered on the stream after the work
that read the previous batch. A layout may end in ``tail`` fields whose sizes change per batch (an island reads
them eagerly, so no graph bakes their size): they follow the fixed fields.

int32 fields (FlashAttention's cumulative lengths) ride in the same buffer as pairs of int32 in int64 words, so no
cast kernel runs on the device. An arena stages into a :class:`HostRing`: a few pinned buffers taken in turn, each
with the numpy views of every layout already made and an event that says when the copy that last read it has run.
Allocating a pinned buffer per forward (torch's caching host allocator) and cutting its views took the largest part
of a short prompt's host time before its graph launched; an unbound layout (an eager batch of any shape) still gets
a fresh buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["Field", "HostRing", "Layout", "MetadataArena", "Staged", "TailPlan"]

# The host view of an empty tail field (nothing is ever written to it).
_EMPTY = {"int64": np.empty(0, dtype=np.int64), "int32": np.empty(0, dtype=np.int32)}
_MAX_TAIL_PLANS = 64  # per layout; more distinct tail lengths than this start the cache afresh


@dataclass(frozen=True)
class Field:
    """One named field: ``length`` values of ``dtype`` ("int64" or "int32")."""

    name: str
    length: int
    dtype: str = "int64"

    @property
    def words(self) -> int:
        """int64 words it occupies (int32 values are packed two to a word)."""
        return self.length if self.dtype == "int64" else (self.length + 1) // 2


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: a ring's cache key, made once per lengths
class TailPlan:
    """A layout's non-empty tails at given lengths: their fields, every field's offset, the words in all, and for
    a layout bound to an arena its device views by name and the arena's words the copy fills."""

    fields: tuple[Field, ...]
    offsets: dict[str, int]
    num_words: int
    device_views: dict[str, Tensor] | None
    device_words: Tensor | None


class Layout:
    """Offsets of the fixed fields of one forward shape and the names of its variable-size tail fields.

    A layout bound to an arena (``buffer`` given) hands out the same device views for every batch; an unbound one
    (eager batches of any shape) gets fresh device memory at each upload.
    """

    def __init__(self, fields: list[Field], tail: tuple[Field, ...] = (), buffer: Tensor | None = None) -> None:
        self.fields = {f.name: f for f in fields}
        self.tail = tail
        self.offsets: dict[str, int] = {}
        offset = 0
        for f in fields:
            self.offsets[f.name] = offset
            offset += f.words
        self.num_words = offset
        self.buffer = buffer
        if buffer is not None and offset > buffer.numel():
            raise ValueError(f"a layout of {offset} words does not fit the arena of {buffer.numel()}")
        self.views = {f.name: self._view(buffer, f, self.offsets[f.name]) for f in fields} if buffer is not None else {}
        # What a batch whose tails are all empty (the common case) needs, made once, since a tensor slice costs
        # microseconds and a batch is staged while the GPU waits: the arena's words it fills, the offsets of its
        # fields, and every device view (an empty one per tail).
        self.capacity = buffer.numel() if buffer is not None else 0
        self.words = buffer[:offset] if buffer is not None else None
        self.empty_tail_offsets = {**self.offsets, **{f.name: offset for f in tail}}
        self.empty_tail_views = {**self.views, **{f.name: self._view(buffer, f, offset) for f in tail}} \
            if buffer is not None else {}
        self._tail_plans: dict[tuple[int, ...], TailPlan] = {}

    def tail_plan(self, lengths: tuple[int, ...]) -> TailPlan:
        """Where the tails of these ``lengths`` (in ``tail``'s order, at least one not zero) go, made once per
        lengths: a batch's request count repeats, and cutting the fields, offsets and views again for every batch
        took a breakable replay's staging from about 5 to 24 µs on the development CPU (a whole-step graph's batch
        has no tails)."""
        plan = self._tail_plans.get(lengths)
        if plan is None:
            if len(self._tail_plans) >= _MAX_TAIL_PLANS:  # lengths that read prefixes vary: keep the recent ones
                self._tail_plans.clear()
            offsets, fields, offset = dict(self.offsets), [], self.num_words
            for f, length in zip(self.tail, lengths):
                fields.append(f if f.length == length else Field(f.name, length, f.dtype))
                offsets[f.name] = offset
                offset += fields[-1].words
            views = None
            if self.buffer is not None:
                views = {**self.views, **{f.name: self._view(self.buffer, f, offsets[f.name]) for f in fields}}
            words = self.buffer[:offset] if self.buffer is not None else None
            plan = self._tail_plans[lengths] = TailPlan(tuple(fields), offsets, offset, views, words)
        return plan

    @staticmethod
    def _view(words: Tensor, f: Field, offset: int) -> Tensor:
        view = words[offset : offset + f.words]
        return view if f.dtype == "int64" else view.view(torch.int32)[: f.length]

    def host_views(self, words: np.ndarray, fields: list[Field] | None = None,
                   offsets: dict[str, int] | None = None) -> dict[str, np.ndarray]:
        """numpy views of ``fields`` (default: the fixed ones) in the host buffer ``words``."""
        offsets = offsets or self.offsets
        views: dict[str, np.ndarray] = {}
        for f in self.fields.values() if fields is None else fields:
            view = words[offsets[f.name] : offsets[f.name] + f.words]
            views[f.name] = view if f.dtype == "int64" else view.view(np.int32)[: f.length]
        return views


class HostRing:
    """Host buffers that an arena's batches are staged in, taken in turn (pinned on CUDA).

    A buffer is written again only after the copy that last read it has run: :meth:`take` waits for that copy's
    event, which is a wait only when ``size`` forwards' copies are all still queued behind the GPU's work (the host is
    then that far ahead, and the wait costs the device nothing). Each buffer keeps the numpy views of the layouts
    staged in it, so staging a batch cuts none.

    Example:
        >>> ring = HostRing(torch.device("cpu"), size=2)
        >>> first, second, third = ring.take(8), ring.take(8), ring.take(8)
        >>> (first, second, third), ring.buffer(first).numel() >= 8
        ((0, 1, 0), True)
    """

    MIN_WORDS = 1 << 12  # a buffer's least size: 32 KiB holds a short prompt's metadata, so it never grows then

    def __init__(self, device: torch.device, size: int = 4) -> None:
        self.device, self.size = device, size
        self._pin = device.type == "cuda"
        self._buffers: list[Tensor | None] = [None] * size
        self._arrays: list[np.ndarray | None] = [None] * size
        self._views: list[dict[object, tuple[Tensor, dict[str, np.ndarray]]]] = [{} for _ in range(size)]
        self._events: list[torch.cuda.Event | None] = [None] * size
        self._next = 0

    def take(self, words: int) -> int:
        """The index of the next buffer, at least ``words`` long and no longer read by any queued copy."""
        i = self._next
        self._next = (i + 1) % self.size
        event = self._events[i]
        if event is not None:
            event.synchronize()  # normally long done: `size` forwards ago
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < words:
            size = max(words, self.MIN_WORDS, 2 * (buffer.numel() if buffer is not None else 0))
            buffer = self._buffers[i] = torch.empty(size, dtype=torch.int64, pin_memory=self._pin)
            self._arrays[i] = buffer.numpy()
            self._views[i].clear()
        return i

    def buffer(self, i: int) -> Tensor:
        """Buffer ``i`` (all of it)."""
        buffer = self._buffers[i]
        assert buffer is not None, "take() the buffer first"
        return buffer

    def views(self, i: int, layout: Layout) -> tuple[Tensor, dict[str, np.ndarray]]:
        """Buffer ``i``'s words that ``layout``'s fixed fields take, and the numpy views by name of those fields and
        of its tails when empty (made once)."""
        views = self._views[i].get(layout)
        if views is None:
            host = {**layout.host_views(self.array(i)), **{f.name: _EMPTY[f.dtype] for f in layout.tail}}
            views = self._views[i][layout] = (self.buffer(i)[: layout.num_words], host)
        return views

    def tail_views(self, i: int, layout: Layout, plan: TailPlan) -> tuple[Tensor, dict[str, np.ndarray]]:
        """:meth:`views` for a batch with the non-empty tails of ``plan``: buffer ``i``'s words it takes, and the
        numpy views of every field (made once per buffer, layout and plan)."""
        key = plan  # one layout's (the key holds it: no later plan can take its identity)
        views = self._views[i].get(key)
        if views is None:
            if len(self._views[i]) >= 4 * _MAX_TAIL_PLANS:  # as the layouts' plans: keep the recent ones
                self._views[i].clear()
            host = {**self.views(i, layout)[1], **layout.host_views(self.array(i), list(plan.fields), plan.offsets)}
            views = self._views[i][key] = (self.buffer(i)[: plan.num_words], host)
        return views

    def array(self, i: int) -> np.ndarray:
        """Buffer ``i`` as numpy."""
        array = self._arrays[i]
        assert array is not None, "take() the buffer first"
        return array

    def copied(self, i: int) -> None:
        """Buffer ``i``'s copy was just queued on the current stream: it may be written again once that has run."""
        if self._pin:
            event = self._events[i]
            if event is None:
                event = self._events[i] = torch.cuda.Event()
            event.record()


class Staged:
    """One batch's fields on the host (:attr:`host`, numpy views to fill) and, after :meth:`upload`, on the device
    (:attr:`device`, tensor views). With ``ring`` (an arena's) the host buffer is one of the ring's, else a fresh
    one (pinned on CUDA)."""

    def __init__(self, layout: Layout, tail_lengths: dict[str, int], device: torch.device,
                 ring: HostRing | None = None) -> None:
        self.layout, self.device_type = layout, device
        self.offsets, offset = layout.offsets, layout.num_words
        self.tail_fields: tuple[Field, ...] = ()  # the tails with something in them (empty ones have fixed views)
        self._plan: TailPlan | None = None
        lengths = tuple(tail_lengths.get(f.name, 0) for f in layout.tail)
        if any(lengths):
            plan = self._plan = layout.tail_plan(lengths)
            self.tail_fields, self.offsets, offset = plan.fields, plan.offsets, plan.num_words
        elif layout.tail:
            self.offsets = layout.empty_tail_offsets
        self.num_words = offset
        if layout.buffer is not None and offset > layout.capacity:
            raise ValueError(f"a batch of {offset} metadata words does not fit the arena of {layout.capacity}")
        self._ring, self._slot = ring, -1
        if ring is None:
            self._host = torch.empty(offset, dtype=torch.int64, pin_memory=device.type == "cuda")
            fields = [*layout.fields.values(), *self.tail_fields]
            self.host = layout.host_views(self._host.numpy(), fields, self.offsets)
            self.host.update({f.name: _EMPTY[f.dtype] for f in layout.tail if f.name not in self.host})
        else:
            self._slot = ring.take(offset)
            if self._plan is not None:
                self._host, self.host = ring.tail_views(self._slot, layout, self._plan)
            else:
                self._host, self.host = ring.views(self._slot, layout)
        self.device: dict[str, Tensor] = {}

    def upload(self) -> dict[str, Tensor]:
        """Copies every field to the device in one non-blocking copy (from pinned memory on CUDA); returns the
        device views by name."""
        layout, device, plan = self.layout, self.device_type, self._plan
        if layout.buffer is not None:
            words = layout.words if plan is None else plan.device_words
            words.copy_(self._host, non_blocking=True)
            views = dict(layout.empty_tail_views if plan is None else plan.device_views)
        else:
            words = self._host.to(device, non_blocking=True) if device.type != "cpu" else self._host
            views = {f.name: Layout._view(words, f, self.offsets[f.name])
                     for f in [*layout.fields.values(), *layout.tail]}
            for f in self.tail_fields:
                views[f.name] = Layout._view(words, f, self.offsets[f.name])
        if self._ring is not None:
            self._ring.copied(self._slot)
        self.device = views
        return views


class MetadataArena:
    """The device buffer behind every captured bucket's fields (see the module docstring), and the host ring its
    batches are staged in.

    Args:
        device: where the fields go.
        capacity: int64 words: the largest bucket's fixed fields plus the largest tail a batch can have.

    Example:
        >>> arena = MetadataArena(torch.device("cpu"), capacity=64)
        >>> layout = arena.layout([Field("ids", 4), Field("cu", 3, "int32")], tail=(Field("keys", 0),))
        >>> staged = arena.stage(layout, keys=2)
        >>> staged.host["ids"][:] = [5, 6, 7, 8]; staged.host["cu"][:] = [0, 2, 4]; staged.host["keys"][:] = [1, 3]
        >>> views = staged.upload()
        >>> views["ids"].tolist(), views["cu"].dtype, views["keys"].tolist()
        ([5, 6, 7, 8], torch.int32, [1, 3])
        >>> views["ids"].data_ptr() == layout.views["ids"].data_ptr()      # the same address for every batch
        True
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.ring = HostRing(device)

    def layout(self, fields: list[Field], tail: tuple[Field, ...] = ()) -> Layout:
        """A layout at fixed offsets of this arena (for one captured bucket)."""
        return Layout(fields, tail, self.buffer)

    def stage(self, layout: Layout, **tail_lengths: int) -> Staged:
        """A host buffer for one batch in ``layout`` (``tail_lengths``: the size of each tail field)."""
        return Staged(layout, tail_lengths, self.device, self.ring)

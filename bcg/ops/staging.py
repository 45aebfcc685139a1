"""A forward's metadata on its way to the device: named integer fields, one pinned host buffer, one copy.

Everything between a call to ``prefill`` and the first kernel leaves the GPU idle, and a graph reads its inputs
from fixed addresses. So every piece of a forward's metadata (the runner's token ids and positions, the attention
backend's KV slots and cumulative lengths) is a named field of one :class:`Layout`: the host writes the fields
with numpy into one pinned buffer and :meth:`Staged.upload` moves them in one non-blocking copy. A layout made for
a captured bucket (:meth:`MetadataArena.layout`) puts its fields at fixed offsets of the arena's device buffer,
so the graphs captured against its views read every later batch staged into it; every bucket's layout starts at
offset 0, because one runner replays one bucket at a time and the copy is ordered on the stream after the work
that read the previous batch. A layout may end in ``tail`` fields whose sizes change per batch (an island reads
them eagerly, so no graph bakes their size): they follow the fixed fields.

int32 fields (FlashAttention's cumulative lengths) ride in the same buffer as pairs of int32 in int64 words, so no
cast kernel runs on the device. Pinned buffers come from torch's caching host allocator, which keeps a buffer
from being reused until the copy that read it has run, so staging the next batch never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["Field", "Layout", "MetadataArena", "Staged"]


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

    @staticmethod
    def _view(words: Tensor, f: Field, offset: int) -> Tensor:
        view = words[offset : offset + f.words]
        return view if f.dtype == "int64" else view.view(torch.int32)[: f.length]


class Staged:
    """One batch's fields on the host (:attr:`host`, numpy views to fill) and, after :meth:`upload`, on the device
    (:attr:`device`, tensor views)."""

    def __init__(self, layout: Layout, tail_lengths: dict[str, int], device: torch.device) -> None:
        self.layout, self.device_type = layout, device
        self.tail_fields = [Field(f.name, tail_lengths.get(f.name, 0), f.dtype) for f in layout.tail]
        self.offsets = dict(layout.offsets)
        offset = layout.num_words
        for f in self.tail_fields:
            self.offsets[f.name] = offset
            offset += f.words
        self.num_words = offset
        pin = device.type == "cuda"
        self._host = torch.empty(offset, dtype=torch.int64, pin_memory=pin)
        words = self._host.numpy()
        self.host: dict[str, np.ndarray] = {}
        for f in [*layout.fields.values(), *self.tail_fields]:
            view = words[self.offsets[f.name] : self.offsets[f.name] + f.words]
            self.host[f.name] = view if f.dtype == "int64" else view.view(np.int32)[: f.length]
        self.device: dict[str, Tensor] = {}

    def upload(self) -> dict[str, Tensor]:
        """Copies every field to the device in one non-blocking copy (from pinned memory on CUDA); returns the
        device views by name."""
        layout, device = self.layout, self.device_type
        if layout.buffer is not None:
            words = layout.buffer
            words[: self.num_words].copy_(self._host, non_blocking=True)
            views = dict(layout.views)
        else:
            words = self._host.to(device, non_blocking=True) if device.type != "cpu" else self._host
            views = {f.name: Layout._view(words, f, self.offsets[f.name]) for f in layout.fields.values()}
        for f in self.tail_fields:
            views[f.name] = Layout._view(words, f, self.offsets[f.name])
        self.device = views
        return views


class MetadataArena:
    """The device buffer behind every captured bucket's fields (see the module docstring).

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

    def layout(self, fields: list[Field], tail: tuple[Field, ...] = ()) -> Layout:
        """A layout at fixed offsets of this arena (for one captured bucket)."""
        return Layout(fields, tail, self.buffer)

    def stage(self, layout: Layout, **tail_lengths: int) -> Staged:
        """A host buffer for one batch in ``layout`` (``tail_lengths``: the size of each tail field)."""
        staged = Staged(layout, tail_lengths, self.device)
        if layout.buffer is not None and staged.num_words > layout.buffer.numel():
            raise ValueError(f"a batch of {staged.num_words} metadata words does not fit the arena of "
                             f"{layout.buffer.numel()}")
        return staged

"""Blocks kept and moved in a narrower dtype than they compute in (``apply_dlo``'s
``weights_dtype``).

A block's bytes are copied and gathered every step, and its host shards (or a rank's own copy)
stay in memory all along: storing them in bf16 or fp8 halves or quarters all three against fp32
(bf16: against bf16, fp8 halves them). The cast happens once, when the host copy is built; after
a block arrives in its slot it is upcast into the dtype the model computes in (``upcast``), so
the forward itself is unchanged.

Which tensor is stored how (``stored_dtype``):

- ``checkpoint``: every tensor as the model has it: the engine does exactly what it did before
  this option existed.
- ``bf16``: floating-point tensors wider than two bytes become bfloat16; fp16 stays fp16 (the
  same size, and more mantissa than bfloat16).
- ``fp8``: the weights of linear and convolution layers (two or more dimensions, more than one
  output channel) become ``float8_e4m3fn`` with one float32 scale per output channel (dim 0):
  ``scale = amax / 448``, the largest magnitude of the channel mapped onto e4m3's largest
  finite value. The other floating-point tensors (biases, norms, modulation tables: a small
  share of the bytes, and where a single scale would cost most) are stored as for ``bf16``.

Integer and bool tensors are never cast. A block's scales travel with it: they are regions of the
block's stored buffer (``stored_layout``), so one copy and one gather still move a whole block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from runtime.budget import WEIGHTS_DTYPES
from runtime.dlo.layout import ALIGN_BYTES, BlockLayout, Entry, _round_up, tensor_nbytes

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32
SCALE_SUFFIX = ":scale"  # a scale region's name: the scaled tensor's name and this


def check_weights_dtype(weights_dtype: str) -> None:
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, "
                         f"got {weights_dtype!r}")


def stored_dtype(dtype: torch.dtype, shape: tuple[int, ...], weights_dtype: str) -> torch.dtype:
    """The dtype a block tensor of ``dtype`` and ``shape`` is kept and moved in."""
    if weights_dtype == "checkpoint" or not dtype.is_floating_point:
        return dtype
    size = torch.empty((), dtype=dtype).element_size()
    if weights_dtype == "fp8" and len(shape) >= 2 and shape[0] > 1 and 0 not in shape \
            and size > 1:
        return FP8
    return torch.bfloat16 if size > 2 else dtype


def stored_layout(lay: BlockLayout, weights_dtype: str, shard_count: int) -> BlockLayout:
    """Block ``lay`` as it is stored: ``lay`` itself when no tensor of it is cast; else a layout
    of the same tensors in their stored dtypes (same order, each on a 64-byte boundary), then a
    float32 scale region per fp8 tensor, padded to equal shards as ``lay`` is."""
    entries: list[Entry] = []
    scales: list[Entry] = []
    offset = 0
    for e in lay.entries:
        dtype = stored_dtype(e.dtype, e.shape, weights_dtype)
        nbytes = tensor_nbytes(dtype, e.shape)
        entries.append(Entry(e.name, e.module, e.attr, e.is_param, dtype, e.shape, offset,
                             nbytes))
        offset = _round_up(offset + nbytes, ALIGN_BYTES)
        if dtype == FP8 and e.dtype != FP8:
            scales.append(Entry(e.name + SCALE_SUFFIX, e.module, e.attr, False, SCALE_DTYPE,
                                (e.shape[0],), 0, tensor_nbytes(SCALE_DTYPE, (e.shape[0],))))
    if all(s.dtype == e.dtype for s, e in zip(entries, lay.entries, strict=True)):
        return lay
    for s in scales:
        entries.append(Entry(s.name, s.module, s.attr, False, s.dtype, s.shape, offset,
                             s.nbytes))
        offset = _round_up(offset + s.nbytes, ALIGN_BYTES)
    padded = _round_up(max(offset, 1), shard_count * ALIGN_BYTES)
    return BlockLayout(lay.index, lay.path, tuple(entries), padded, padded // shard_count)


def fp8_scale(t: torch.Tensor) -> torch.Tensor:
    """One float32 scale per output channel (dim 0) of ``t``: its largest magnitude / 448 (1
    for a channel of zeros)."""
    amax = t.detach().reshape(t.shape[0], -1).abs().amax(dim=1).to(SCALE_DTYPE)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as stored in ``dtype`` (fp8: divided by its channels' scales, then rounded)."""
    if dtype != FP8 or t.dtype == FP8:
        return t.to(dtype)
    rows = t.detach().reshape(t.shape[0], -1).to(SCALE_DTYPE) / fp8_scale(t)[:, None]
    return rows.clamp_(-FP8_MAX, FP8_MAX).to(FP8).reshape(t.shape)


@dataclass(frozen=True, slots=True)
class Upcast:
    """One stored tensor of a block, and where its compute-dtype self goes."""

    entry: Entry  # the tensor as the model computes with it
    stored: Entry  # as stored, in the block's stored buffer
    scale: Entry | None  # fp8: its scales' region in the stored buffer
    offset: int  # byte offset of the upcast tensor in the compute buffer


def upcast_plan(lay: BlockLayout, stored: BlockLayout, *,
                whole: bool = False) -> tuple[tuple[Upcast, ...], int]:
    """The tensors of block ``lay`` to upcast from ``stored``, and the compute buffer's size:
    only the cast ones, packed on 64-byte boundaries (a streamed block: the others are used
    from the slot as they arrived); or, ``whole``, every tensor at ``lay``'s own offsets (a
    resident block's buffer of its own)."""
    scales = {e.name: e for e in stored.entries[len(lay.entries):]}
    plan = []
    offset = 0
    for e, s in zip(lay.entries, stored.entries, strict=False):
        if whole:
            plan.append(Upcast(e, s, scales.get(e.name + SCALE_SUFFIX), e.offset))
        elif s.dtype != e.dtype:
            plan.append(Upcast(e, s, scales.get(e.name + SCALE_SUFFIX), offset))
            offset = _round_up(offset + e.nbytes, ALIGN_BYTES)
    return tuple(plan), (lay.padded_bytes if whole else offset)


def packed(plan: Sequence[Upcast], base: int = 0) -> tuple[tuple[Upcast, ...], int]:
    """``plan``'s tensors packed anew from byte ``base`` of the compute buffer (each on a
    64-byte boundary), and the offset where they end."""
    out = []
    offset = base
    for u in plan:
        out.append(replace(u, offset=offset))
        offset = _round_up(offset + u.entry.nbytes, ALIGN_BYTES)
    return tuple(out), offset


@dataclass(frozen=True, slots=True)
class RowChunks:
    """A Linear's cast weight upcast a few output rows at a time into a region of ``rows`` rows
    (``upcast.offset``), each chunk's share of the output computed before the next overwrites
    it (`upcast_rows`): a compute buffer of a chunk, not of the largest layer."""

    upcast: Upcast
    rows: int


def chunk_rows(e: Entry, chunk_bytes: int) -> int:
    """Rows of weight ``e`` per chunk: the most whole multiple of 64 rows that fits in
    ``chunk_bytes`` in its compute dtype, and at least 64. Matrix kernels tile output columns
    in such multiples, so a product split there sums each output exactly as the whole one does
    (on the CPU: tests/runtime/test_weights_dtype.py)."""
    rows = chunk_bytes // (e.nbytes // e.shape[0])
    return max(64, rows - rows % 64)


def upcast_rows(u: Upcast, src: torch.Tensor, dst: torch.Tensor, start: int, stop: int) -> None:
    """Rows ``[start, stop)`` of ``u``'s tensor, in its compute dtype, into ``dst`` (a tensor of
    that many rows): the same values `upcast` writes for them."""
    s = u.stored
    dst.copy_(src[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)[start:stop])
    if u.scale is not None:
        scale = src[u.scale.offset : u.scale.offset + u.scale.nbytes].view(SCALE_DTYPE)
        dst.mul_(scale[start:stop].view(-1, *([1] * (dst.dim() - 1))))


def upcast(plan: tuple[Upcast, ...], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Write each tensor of ``plan``, in its compute dtype, into the flat buffer ``dst`` from
    ``src``, the block's stored buffer: one converting copy, then, for an fp8 tensor, a multiply
    by its channels' scales (in float32, rounded once into the compute dtype)."""
    for u in plan:
        e, s = u.entry, u.stored
        out = dst[u.offset : u.offset + e.nbytes].view(e.dtype).view(e.shape)
        out.copy_(src[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape))
        if u.scale is not None:
            scale = src[u.scale.offset : u.scale.offset + u.scale.nbytes].view(SCALE_DTYPE)
            out.mul_(scale.view(-1, *([1] * (len(e.shape) - 1))))

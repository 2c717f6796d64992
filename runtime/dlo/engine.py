"""Distributed layerwise offload (DLO): stream a model's blocks through two fixed device slots.

Each block's tensors are packed into one flat byte buffer (see ``layout.py``). With
``use_allgather=True`` rank r of the weight group keeps only shard r of every block, in one host
slab (page-locked on accelerators); before a block runs, every rank copies its shard into the
block's slot and an all-gather rebuilds the whole block there. With ``use_allgather=False`` each
rank streams whole blocks from their source (the shared checkpoint mapping, or the model's own
tensors) through a page-locked staging buffer.

While block N computes from one slot, a single transfer thread fills the other slot with block
N+1 (on a side stream on accelerators); the last block prefetches block 0 for the next forward.
One thread and one dedicated process group mean every rank issues its gathers in the same order
and they never interleave with other collectives. During its block's forward each parameter is a
view into the active slot; outside it, a meta-device placeholder that holds no memory.

Resident blocks: when the model, or part of it, fits on the device, streaming it only costs
time (SGLang measured +60% latency from offloading a model that fits on an H200). With
``resident_blocks=k``, or a ``device_budget_bytes`` that k blocks plus the two slots fit in, the
first k blocks in streaming order are filled once at set-up (one all-gather each in allgather
mode, a copy from the source in rank-local mode) into device buffers of their own and stay bound
there for the life of the handle; only the others stream, and the slab keeps only their shards.
Every rank of the group uses the same k, the smallest any rank asked for. With every block
resident there are no slots, no transfers and no gathers per forward.

Mapped blocks: on the CPU the device is host memory, and a rank-local resident block read from a
checkpoint needs no buffer at all: its tensors are bound to the checkpoint's file mapping itself,
the pages every rank of the host shares through the page cache. So on the CPU a rank-local group
with every block resident holds one copy of the weights in all, no copy per rank, and does no
transfer per forward (``runtime.budget``'s ``auto`` asks for that on the CPU).

Stored dtype: with ``weights_dtype="bf16"`` or ``"fp8"`` (``runtime.dlo.cast``) each block is
cast once, while the host copy is built, and the host shards, the slots and every copy and
gather hold it in that dtype: half or a quarter of fp32's bytes. A cast block streams from a host
copy even in rank-local mode (the rank's own copy of every streamed block, since the checkpoint
holds them uncast), and never binds to the checkpoint's mapping. Its cast tensors are upcast
from the slot into one compute-dtype buffer that both slots share, on the compute stream, as
late as they can be: a leaf layer's own (a Linear's weight and bias, a norm's: nearly all the
bytes) just before that layer runs, into a region every layer shares, and bound only for that
layer's forward; the rest (the block's own tensors, such as a modulation table, and those of
modules with submodules, which any part of the block may read) when the block is bound. The
other tensors are used from the slot as they arrived. Device memory for streamed blocks is then
2 x stored + the largest layer in the compute dtype: the buffer holds one layer, not one block
(a Wan block of width 1024: 16 MB for its largest fp32 layer, 4096 x 1024, against 64 MB
for the block), so the cast shrinks the slots without a block-sized buffer coming back beside
them. On the CPU, where the device is host memory, that is what lets bf16 and fp8 shrink a
group's host memory by their ratio, and there a Linear weight larger than
`UPCAST_CHUNK_BYTES` is upcast a chunk of output rows at a time (64 or a multiple), each
chunk's outputs computed before the next overwrites it (`_chunked_linear`): the buffer holds
1 MiB instead of 16 MB, and the output is the whole layer's bit for bit, since the matrix
kernels sum each output over the same inputs in the same order whichever columns they are
asked for (a dp=2 fp8 group on a 1 GB Wan: 510 MB of host memory before, 465 after,
``bench/weights_dtype.py``).
On an accelerator the buffer is device memory and kernels are chosen by shape, so layers are
upcast whole there. The upcast is one element-wise pass over the block,
memory-bound, next to a forward whose matmuls read the same weights once per token tile; split
by layer, it is the same bytes. On the CPU an overlap
would not help anyway (the transfer thread runs on the cores the forward needs); medians on one
thread: a 4096 x 4096 fp32 weight upcasts from bf16 in 34 ms (a plain fp32 copy of it: 37 ms)
and from fp8 with its scales in 290 ms, against 1.9 s for one matmul of 2,048 tokens with it.
A rank sitting a step out (``idle_forward``) gathers without upcasting. Resident blocks are
upcast once, at set-up, into buffers of their own, so a block computes from the same values
wherever it sits. ``checkpoint`` (the default) casts nothing: no compute buffer, no upcast,
the engine as without the option.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any
from typing import cast as typed

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from runtime.dlo import hostmem
from runtime.dlo.cast import (
    SCALE_SUFFIX,
    RowChunks,
    Upcast,
    cast,
    check_weights_dtype,
    chunk_rows,
    fp8_scale,
    packed,
    stored_layout,
    upcast,
    upcast_plan,
    upcast_rows,
)
from runtime.dlo.checkpoint import Checkpoint
from runtime.dlo.layout import (
    ALIGN_BYTES,
    BlockLayout,
    Entry,
    _round_up,
    block_tensors,
    build_layout,
    layout_digest,
)
from runtime.platform import Platform, get_platform
from runtime.step_replay import StepLeft

log = logging.getLogger(__name__)

CheckpointSpec = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

# A ModuleList holding at least this share of the parameters counts as a block list when the
# caller does not name them; together the chosen lists must hold more than half.
_MIN_LIST_SHARE = 0.10


# `DLOHandle.leave_when(late=True)`: how far into a block (a share of the last block's time on
# this rank) the check is still looked at, and how often.
LEAVE_LATE_SHARE = 0.75
LEAVE_LOOK_SECONDS = 0.005
# What a block's measure keeps of the last one's when the block took less (`_acquire`).
LEAVE_MEASURE_KEEP = 0.9
# On the CPU, where the compute buffer is host memory, the most of a cast Linear weight upcast
# at once (`_chunked_linear`): a Wan block of width 1024 in fp8 then needs 1 MiB of it, not 16.
UPCAST_CHUNK_BYTES = 1 << 20


class ForwardLeft(StepLeft):
    """The weight group agreed to leave the forward before one of its blocks (`DLOHandle.
    leave_when`): every rank of the group raised it before the same block, so no gather of the
    rest of the forward is owed to any of them."""


@dataclass(kw_only=True, slots=True)
class DLOConfig:
    use_allgather: bool
    rank: int  # this process's rank in the weight group
    shard_count: int  # ranks sharing the weights (1 in rank-local mode)
    world_size: int  # ranks in the weight group


def find_block_lists(model: nn.Module) -> list[str]:
    """Dotted paths of the outermost ModuleLists that hold most of the parameters."""
    total = sum(p.numel() for p in model.parameters())
    found: list[tuple[str, int]] = []
    for name, mod in model.named_modules():
        if not name or not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue  # nested inside a list already found
        found.append((name, sum(p.numel() for p in mod.parameters())))
    chosen = [name for name, n in found if total and n >= _MIN_LIST_SHARE * total]
    held = sum(n for name, n in found if name in chosen)
    if not chosen or held * 2 <= total:
        largest = max(found, key=lambda item: item[1], default=None)
        detail = (f"the largest, {largest[0]!r}, holds {largest[1] / max(total, 1):.0%} of the "
                  "parameters" if largest else "the model has no nn.ModuleList of 2+ modules")
        raise ValueError(f"no block list found in {type(model).__name__}: {detail}; "
                         "pass blocks=[...] with the dotted paths of its block lists")
    return chosen


def _resolve_block_lists(
    model: nn.Module, blocks: Sequence[str] | None
) -> list[tuple[str, nn.ModuleList | nn.Sequential]]:
    paths = find_block_lists(model) if blocks is None else list(blocks)
    if isinstance(blocks, str):
        raise ValueError(f"blocks must be a list of dotted paths, got the string {blocks!r}")
    out: list[tuple[str, nn.ModuleList | nn.Sequential]] = []
    for path in paths:
        try:
            mod = model.get_submodule(path)
        except AttributeError as exc:
            raise ValueError(f"block list {path!r} not found in {type(model).__name__}") from exc
        if not isinstance(mod, nn.ModuleList | nn.Sequential) or len(mod) == 0:
            raise ValueError(f"block list {path!r} is a {type(mod).__name__}, expected a "
                             "non-empty nn.ModuleList")
        out.append((path, mod))
    for i, (a, _) in enumerate(out):
        for b, _ in out[i + 1:]:
            if a == b or a.startswith(b + ".") or b.startswith(a + "."):
                raise ValueError(f"block lists {a!r} and {b!r} overlap")
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's data (a contiguous copy only if it was not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class _Source:
    """Where a block tensor's bytes come from: the checkpoint mapping or the model's tensor."""

    def __init__(self, checkpoint: Checkpoint | None) -> None:
        self.checkpoint = checkpoint
        self.model_tensors: dict[str, torch.Tensor] = {}
        self._released: list[tuple[str, int, int]] = []

    def bytes(self, name: str) -> torch.Tensor:
        if self.checkpoint is not None:
            return self.checkpoint.byte_view(name)
        return self.model_tensors[name]

    def done_with(self, name: str, begin: int, end: int) -> None:
        """This rank has copied bytes [begin, end) of ``name``; drop them from the page cache."""
        if self.checkpoint is not None:
            self.checkpoint.release(name, begin, end)
            self._released.append((name, begin, end))

    def release_again(self, group: Any) -> None:
        """Evict what another rank's fault-around kept mapped during the first release.

        Every rank unmaps the whole file, waits for the others to do the same, then evicts its
        own ranges again: now no process maps them, so the kernel can drop them.
        """
        if self.checkpoint is None or not self._released:
            return
        self.checkpoint.unmap_all()
        if group is not None:
            dist.barrier(group=group)
        for name, begin, end in self._released:
            self.checkpoint.release(name, begin, end)
        self._released.clear()


def _check_against_checkpoint(
    wanted: list[tuple[tuple[str, ...], torch.Tensor]], ckpt: Checkpoint
) -> list[str]:
    """Problems with ``ckpt`` for tensors known by one or more (tied) names."""
    problems = []
    missing = [names[0] for names, _ in wanted if not any(n in ckpt for n in names)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(f"checkpoint is missing {len(missing)} key(s): {shown}{more}")
    for names, t in wanted:
        for name in (n for n in names if n in ckpt):
            info = ckpt.info(name)
            if info.shape != tuple(t.shape):
                problems.append(f"checkpoint tensor {name!r} has shape {list(info.shape)}, "
                                f"the model expects {list(t.shape)}")
            elif info.dtype != t.dtype:
                problems.append(f"checkpoint tensor {name!r} has dtype {info.dtype}, "
                                f"the model expects {t.dtype}")
    return problems


class DLOHandle:
    """The live offload state of one model. Build it with :func:`apply_dlo`."""

    def __init__(
        self,
        model: nn.Module,
        layouts: list[BlockLayout],
        block_modules: list[nn.Module],
        *,
        config: DLOConfig,
        platform: Platform,
        group: Any,
        owns_group: bool,
        source: _Source,
        resident_bytes: int,
        resident_blocks: int = 0,
        stored: list[BlockLayout] | None = None,
        weights_dtype: str = "checkpoint",
    ) -> None:
        self.model = model
        # The model's blocks, in streaming order (resident ones first).
        self.block_modules = list(block_modules)
        self.config = config
        self.platform = platform
        self._layouts = layouts
        # Each block as it is kept and moved (``runtime.dlo.cast``): the layout itself unless
        # some tensor of it is cast, and then upcast into the compute buffer before its forward.
        self._stored = stored if stored is not None else layouts
        self._casts = [st is not lay for st, lay in zip(self._stored, layouts, strict=True)]
        self.weights_dtype = weights_dtype
        self._entries = {e.name: e for lay in layouts for e in lay.entries}
        self._group = group
        self._owns_group = owns_group
        self._source = source
        self._resident_bytes = resident_bytes
        self._max_block_bytes = max(lay.padded_bytes for lay in layouts)
        # Blocks [0, k) stay on the device for the life of the handle; [k, n) stream.
        self._num_resident = resident_blocks
        self._streamed = layouts[resident_blocks:]
        self._max_streamed_bytes = max((st.padded_bytes for st in self._stored[resident_blocks:]),
                                       default=0)
        # Per streamed cast block, its cast tensors are upcast into the compute buffer (the
        # others are used from the slot as they arrived), in two parts. A leaf layer's own (a
        # Linear's, a norm's: most of the bytes) just before that layer runs, into a region
        # every layer shares (``_make_layer_hooks``); the rest (the block's own tensors, those
        # of modules with submodules, which any part of the block's forward may read) when the
        # block is bound, into the region before it. The buffer fits the largest rest and the
        # largest layer: a layer, not a block, in the compute dtype.
        # On the CPU the buffer is host memory, so a large Linear's weight is upcast a chunk of
        # rows at a time instead (`UPCAST_CHUNK_BYTES`).
        self._upcasts, self._layer_upcasts, self._compute_bytes = _upcast_plans(
            self._streamed, self._stored[resident_blocks:], _chunk_bytes(platform))
        # The cast tensors upcast per layer.
        self._layer_names = {u.entry.name for lu in self._layer_upcasts
                             for u in (*lu.plan, *([lu.chunks.upcast] if lu.chunks else []))}
        # A cast block streams from a host copy in its stored dtype: this rank's shards in
        # allgather mode, the whole blocks in rank-local mode (the source holds them uncast).
        self._host_copy = config.use_allgather or any(self._casts)
        self._shard_index = config.rank if config.use_allgather else 0
        self._lock = threading.Lock()
        self._num_gathers = 0  # collective all-gathers issued, set-up included
        # Bytes this rank copied into block buffers and bytes of the blocks its all-gathers
        # rebuilt: at set-up, then per block acquired (``bytes_moved``).
        self._bytes_copied = 0
        self._bytes_gathered = 0
        self._gather_seconds = 0.0
        self._wait_seconds = 0.0
        self._timing_events: list[tuple[str, Any, Any]] = []  # accelerator intervals to sum
        self._closed = False

        self._placeholders = {
            e.name: self._placeholder(e) for lay in layouts for e in lay.entries
        }
        # On the CPU a rank-local resident block is the checkpoint's mapping (module docstring).
        self._mapped = (not config.use_allgather and not platform.is_accelerator
                        and source.checkpoint is not None and not any(self._casts))
        self._resident_bufs = [platform.empty_device(lay.padded_bytes)
                               for lay in layouts[:resident_blocks]] if not self._mapped else []
        self._slab: torch.Tensor | None = None
        self._shards: list[torch.Tensor | None] = []
        if self._host_copy:
            self._slab, self._shards = self._fill_slab()
            # What building it freed (a cast's temporaries, the model's own block tensors)
            # would otherwise stay in the allocator's arenas for the life of the rank.
            hostmem.trim()
        else:
            self._fill_resident_whole()
        self._staging = (
            platform.empty_host(self._max_streamed_bytes, pinned=True)
            if platform.is_accelerator and not self._host_copy and self._streamed else None
        )
        self._staging_free: Any = None
        self._slots = ([platform.empty_device(self._max_streamed_bytes) for _ in range(2)]
                       if self._streamed else [])
        # One compute-dtype buffer for both slots: a cast block is upcast into it on the compute
        # stream just before its forward (``_bind``); see the module docstring for why one.
        self._compute_buf = (platform.empty_device(self._compute_bytes).zero_()
                             if self._compute_bytes else None)
        self._slot_free: list[Any] = [None, None]  # compute-stream events: slot no longer read
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for lay in layouts[:resident_blocks]:
            # Bound once, for the life of the handle: no hooks, never unbound before close().
            views = (self._mapped_views(lay) if self._mapped
                     else _make_views(lay, self._resident_bufs[lay.index]))
            for e in lay.entries:
                _set_tensor(e, views[e.name])
        self._side_stream = platform.new_stream()
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-dlo")
        self._inflight: dict[int, tuple[int, cf.Future[Any]]] = {}  # block -> (slot, ready)
        self._bound: tuple[int, int] | None = None  # (block, slot) bound as views right now
        self._num_acquired = 0  # blocks acquired since set-up: forwards x blocks, on every rank
        # A forward that may end after its first blocks (`hold_after`, `end_forward`): the block
        # after which no prefetch starts until the group has decided, the slot it took, and the
        # blocks of this forward that no rank runs (their hooks neither acquire nor bind).
        self._hold_index: int | None = None
        self._held_slot: int | None = None
        self._passed: set[int] = set()
        # `leave_when`: asked before each block after a forward's first, agreed on by the group.
        self._leave_check: Callable[[], bool] | None = None
        # The group's answer to the check this rank made as it acquired the block before (an
        # all-reduce queued behind that block's prefetch), read as the next block is acquired.
        self._leave_vote: cf.Future[bool] | None = None
        self._leave_within = False  # a computing rank leaves inside a block once the vote is in
        self._leave_late = False  # this rank's check is looked at until late in each block
        self._vote_needed: threading.Event | None = None  # set: the pending vote is wanted now
        self._acquired_at: float | None = None  # when the last block was acquired (monotonic)
        # Between the last two acquires of one forward on this rank, in a forward that may be
        # left (`leave_when`): the late look's measure (`_leave_flag`). Forwards that may not
        # be left are another job's (an interactive job's blocks, a tenth as long): their
        # blocks would end the first late look of the next batch step almost at once.
        self._block_seconds = 0.0
        self._within_hooks = False  # the pre-hooks that let it are registered
        self._left = False  # the group left the current forward: nothing is owed to catch up
        self._hooks: list[RemovableHandle | _InstanceForward] = []
        for lay, mod in zip(layouts[resident_blocks:], block_modules[resident_blocks:],
                            strict=True):
            self._unbind(lay)
            self._hooks.append(mod.register_forward_pre_hook(self._make_pre_hook(lay.index)))
            self._hooks.append(mod.register_forward_hook(self._make_post_hook(lay.index)))
        for lu in self._layer_upcasts:
            self._hooks.extend(self._make_layer_hooks(lu))
        if self._streamed:
            self._prefetch(self._streamed[0].index, slot=0)

    # ---- set-up -------------------------------------------------------------------------

    @staticmethod
    def _placeholder(e: Entry) -> torch.Tensor:
        t = torch.empty(e.shape, dtype=e.dtype, device="meta")
        return nn.Parameter(t, requires_grad=False) if e.is_param else t

    def _fill_slab(self) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Copy this rank's shard of every block (the whole block in rank-local mode), in its
        stored dtype, straight from the source: a streamed block's into one host slab, a resident
        block's into its place in the block's device buffer, which an all-gather then completes
        (one per resident block, in block order on every rank). A cast resident block is
        gathered in a buffer of its stored size and upcast into its own, for good."""
        index = self._shard_index
        k = self._num_resident
        total = sum(st.shard_bytes for st in self._stored[k:])
        slab = self.platform.empty_host(total, pinned=True) if total else None
        shards: list[torch.Tensor | None] = [None] * k
        cast_sizes = [st.padded_bytes for st, c in zip(self._stored[:k], self._casts, strict=False)
                      if c]
        cast_buf = self.platform.empty_device(max(cast_sizes)) if cast_sizes else None
        pos = 0
        for lay, st in zip(self._layouts, self._stored, strict=True):
            lo, hi = st.shard_range(index)
            if lay.index < k:
                if st is lay:
                    full = self._resident_bufs[lay.index]
                else:
                    assert cast_buf is not None  # a cast resident block: cast_sizes has its size
                    full = cast_buf[: st.padded_bytes]
                shard = full[lo:hi]
            else:
                assert slab is not None
                shard = slab[pos : pos + st.shard_bytes]
                pos += st.shard_bytes
                shards.append(shard)
            shard.zero_()  # padding bytes, so every rank gathers deterministic contents
            for e in st.entries:
                begin, end = max(lo, e.offset), min(hi, e.offset + e.nbytes)
                if begin >= end:
                    continue
                src = self._stored_bytes(e)
                shard[begin - lo : end - lo].copy_(src[begin - e.offset : end - e.offset])
                self._done_with(e, begin - e.offset, end - e.offset)
            if lay.index < k and st is not lay:
                self._bytes_gathered += self._gather_whole(full, lo, hi)
                whole, _ = upcast_plan(lay, st, whole=True)
                upcast(whole, full, self._resident_bufs[lay.index].zero_())
        self._source.release_again(self._group)
        # The model's own copies of the block tensors are no longer needed.
        self._source.model_tensors.clear()
        for lay, st, buf in zip(self._layouts[:k], self._stored, self._resident_bufs,
                                strict=False):
            if st is lay:
                self._bytes_gathered += self._gather_whole(buf, *lay.shard_range(index))
        return slab, shards

    def _gather_whole(self, buf: torch.Tensor, lo: int, hi: int) -> int:
        """Complete block buffer ``buf`` from the shards, this rank's at [lo, hi) (sharded
        groups only; in rank-local mode ``buf`` is whole already); return the bytes gathered."""
        if self.config.shard_count == 1:
            return 0
        _all_gather(buf, buf[lo:hi], self._group)
        with self._lock:
            self._num_gathers += 1
        return buf.numel()

    def _stored_bytes(self, e: Entry) -> torch.Tensor:
        """The bytes of stored tensor (or scale region) ``e``: the source's own when it is not
        cast, else the source's tensor cast to ``e.dtype``."""
        name = e.name.removesuffix(SCALE_SUFFIX)
        if name != e.name:
            return _bytes_of(fp8_scale(self._source_tensor(self._entries[name])))
        if e.dtype == self._entries[name].dtype:
            return self._source.bytes(name)
        return _bytes_of(cast(self._source_tensor(self._entries[name]), e.dtype))

    def _source_tensor(self, e: Entry) -> torch.Tensor:
        return self._source.bytes(e.name).view(e.dtype).view(e.shape)

    def _done_with(self, e: Entry, begin: int, end: int) -> None:
        """This rank has copied bytes [begin, end) of stored tensor ``e``: release the source
        bytes they came from (a cast tensor's in proportion: the cast works element-wise)."""
        name = e.name.removesuffix(SCALE_SUFFIX)
        if name != e.name:
            return  # a scale: derived from the tensor, whose own bytes are released with it
        source_nbytes = self._entries[name].nbytes
        if source_nbytes != e.nbytes:
            begin, end = begin * source_nbytes // e.nbytes, end * source_nbytes // e.nbytes
        self._source.done_with(name, begin, end)

    def _mapped_views(self, lay: BlockLayout) -> dict[str, torch.Tensor]:
        """Each tensor of block ``lay`` as the checkpoint's own mapped tensor (CPU, rank-local)."""
        assert self._source.checkpoint is not None
        views: dict[str, torch.Tensor] = {}
        for e in lay.entries:
            t = self._source.checkpoint.tensor(e.name)
            views[e.name] = nn.Parameter(t, requires_grad=False) if e.is_param else t
        return views

    def _fill_resident_whole(self) -> None:
        """Rank-local mode: copy each resident block whole from the source into its buffer
        (mapped blocks need no copy: they are bound to the checkpoint in ``__init__``)."""
        if self._mapped:
            return
        for lay, buf in zip(self._layouts[: self._num_resident], self._resident_bufs,
                            strict=True):
            buf.zero_()
            for e in lay.entries:
                buf[e.offset : e.offset + e.nbytes].copy_(self._source.bytes(e.name))
                # Only streamed blocks are read from the source again.
                self._source.model_tensors.pop(e.name, None)

    # ---- the transfer thread ------------------------------------------------------------

    def _load(self, index: int, slot_index: int) -> tuple[Any, int, int]:
        """Runs on the transfer thread: fill ``slot_index`` with block ``index``; return the
        event that marks it done and the bytes copied and gathered for it (counted when the
        block is acquired, so that a step's count holds the blocks it used)."""
        st = self._stored[index]
        slot = self._slots[slot_index][: st.padded_bytes]
        p = self.platform
        t0 = time.perf_counter()
        with p.use_stream(self._side_stream):
            start = p.record_event(self._side_stream)
            if self._slot_free[slot_index] is not None:
                # The previous block in this slot may still be computing on the compute stream.
                p.wait_event(self._slot_free[slot_index], self._side_stream)
            if self._host_copy:
                lo, hi = st.shard_range(self._shard_index)
                shard = self._shards[index]
                assert shard is not None, "a resident block never streams"
                slot[lo:hi].copy_(shard, non_blocking=True)
                copied = hi - lo
                # In place: this rank's shard already sits at its position in the output.
                gathered = self._gather_whole(slot, lo, hi)
            else:
                copied, gathered = self._stream_whole_block(st, slot), 0
            ready = p.record_event(self._side_stream)
        if p.is_accelerator:
            self._add_timing("gather", start, ready)
        else:
            with self._lock:
                self._gather_seconds += time.perf_counter() - t0
        return ready, copied, gathered

    def _stream_whole_block(self, lay: BlockLayout, slot: torch.Tensor) -> int:
        p = self.platform
        dst = slot if self._staging is None else self._staging[: lay.padded_bytes]
        if self._staging_free is not None:
            # The previous block's copy out of the staging buffer must finish before reuse.
            p.synchronize_event(self._staging_free)
        for e in lay.entries:
            dst[e.offset : e.offset + e.nbytes].copy_(self._source.bytes(e.name))
        if self._staging is not None:
            slot.copy_(dst, non_blocking=True)
            self._staging_free = p.record_event(self._side_stream)
        return sum(e.nbytes for e in lay.entries)

    def _prefetch(self, index: int, slot: int) -> None:
        self._inflight[index] = (slot, self._executor.submit(self._load, index, slot))

    def _next(self, index: int) -> int:
        # The last streamed block prefetches the first streamed block for the next forward.
        nxt = index + 1
        return nxt if nxt < len(self._layouts) else self._num_resident

    # ---- the forward --------------------------------------------------------------------

    def _acquire(self, index: int) -> int:
        """Wait until block ``index`` is in a slot, start the next prefetch, return the slot."""
        if self._closed:
            raise RuntimeError("this DLO handle is closed")
        if self._bound is not None:  # a previous forward raised inside a block
            self._unbind(self._layouts[self._bound[0]])
            self._release(*self._bound)  # after what its forward had queued on the device
            self._bound = None
        now = time.monotonic()
        if (index != self._num_resident and self._acquired_at is not None
                and self._leave_check is not None):
            # A block given back from a step left before (`runtime.step_replay`) computes
            # nothing: its millisecond must not end the look at the next one at once, so the
            # measure falls by at most a tenth a block.
            self._block_seconds = max(now - self._acquired_at,
                                      LEAVE_MEASURE_KEEP * self._block_seconds)
        self._acquired_at = now
        vote, self._leave_vote = self._leave_vote, None
        self._want_vote()
        if vote is not None and vote.result():
            # Every rank reads the same answer before the same block: they all leave here.
            self._left = True
            raise ForwardLeft(f"the group left the forward before block {index}")
        if index == self._num_resident:
            self._left = False  # a new forward
        if index not in self._inflight:
            # The blocks ran out of the declared order. Every rank runs the same code, so every
            # rank takes this branch too and the gathers stay in step.
            log.debug("DLO: block %d requested out of order; loading it synchronously", index)
            for _, fut in self._inflight.values():
                fut.result()
            self._inflight.clear()
            self._prefetch(index, slot=0)
        slot, fut = self._inflight.pop(index)
        self._num_acquired += 1
        p = self.platform
        t0 = time.perf_counter()
        ready, copied, gathered = fut.result()
        with self._lock:
            self._bytes_copied += copied
            self._bytes_gathered += gathered
        if p.is_accelerator:
            before = p.record_event()
            p.wait_event(ready)  # compute must not read the slot before the gather lands
            self._add_timing("wait", before, p.record_event())
        else:
            with self._lock:
                self._wait_seconds += time.perf_counter() - t0
        if index == self._hold_index:
            # What comes next is decided after this block's forward (`end_forward`).
            self._hold_index, self._held_slot = None, slot
        else:
            self._prefetch(self._next(index), slot=1 - slot)
            if self._leave_check is not None:
                # Agreed on behind the prefetch, while this block computes: the ranks wait for
                # each other no more than the gather makes them. After a forward's last block,
                # read by the next forward of the step, or inside the block only.
                self._leave_vote = self._vote(self._leave_flag(now))
        return slot

    def _leave_flag(self, acquired_at: float) -> Callable[[], bool]:
        """This rank's part of the vote on leaving before the next block: its check, looked at
        on the transfer thread once the next block's gather is done. With ``late``, looked at
        again every ``LEAVE_LOOK_SECONDS`` until ``LEAVE_LATE_SHARE`` of a block's time after
        this block was acquired (or the vote is wanted before): the group learns of what
        happened during most of the block, not only before it, and a peer waits for the vote
        no longer than that."""
        check = self._leave_check
        assert check is not None
        if not self._leave_late or self._block_seconds <= 0:
            return check
        needed = self._vote_needed = threading.Event()
        deadline = acquired_at + LEAVE_LATE_SHARE * self._block_seconds

        def late() -> bool:
            while not check():
                left = deadline - time.monotonic()
                if left <= 0 or needed.is_set():
                    return False
                needed.wait(min(left, LEAVE_LOOK_SECONDS))
            return True

        return late

    def _want_vote(self) -> None:
        """The pending vote is wanted now: a late look at this rank's check ends."""
        if self._vote_needed is not None:
            self._vote_needed.set()
            self._vote_needed = None

    def _add_timing(self, kind: str, start: Any, end: Any) -> None:
        """Keep an accelerator interval to sum later; fold finished ones in as the list grows,
        so a worker that renders all night without calling stats() holds a bounded list."""
        with self._lock:
            self._timing_events.append((kind, start, end))
            if len(self._timing_events) < 512:
                return
            pending = []
            for k, a, b in self._timing_events:
                if b.query():
                    self._add_seconds(k, self.platform.event_elapsed_seconds(a, b))
                else:
                    pending.append((k, a, b))
            self._timing_events = pending

    def _add_seconds(self, kind: str, seconds: float) -> None:
        if kind == "gather":
            self._gather_seconds += seconds
        else:
            self._wait_seconds += seconds

    def _release(self, index: int, slot: int) -> None:
        # Recorded on the compute stream: the next fill of this slot waits for it.
        self._slot_free[slot] = self.platform.record_event()

    def _views_for(self, index: int, slot: int) -> dict[str, torch.Tensor]:
        key = (index, slot)
        if key not in self._views:
            lay = self._layouts[index]
            if index not in self._upcasts:
                self._views[key] = _make_views(lay, self._slots[slot])
            else:
                # Cast tensors from the compute buffer, the others from the slot.
                assert self._compute_buf is not None
                places = {e.name: (self._slots[slot], s.offset)
                          for e, s in zip(lay.entries, self._stored[index].entries,
                                          strict=False)}
                places.update({u.entry.name: (self._compute_buf, u.offset)
                               for u in self._upcasts[index]})
                # A layer's cast tensors are bound by its own hooks, only while it runs.
                self._views[key] = {e.name: (self._placeholders[e.name]
                                             if e.name in self._layer_names
                                             else _view(e, *places[e.name]))
                                    for e in lay.entries}
        return self._views[key]

    def _bind(self, index: int, slot: int) -> None:
        if index in self._upcasts:
            assert self._compute_buf is not None
            # On the compute stream, which waits for the block's arrival (``_acquire``) and
            # ran the previous block's forward from this buffer before.
            upcast(self._upcasts[index], self._slots[slot], self._compute_buf)
        views = self._views_for(index, slot)
        for e in self._layouts[index].entries:
            _set_tensor(e, views[e.name])
        self._bound = (index, slot)

    def _unbind(self, lay: BlockLayout) -> None:
        for e in lay.entries:
            _set_tensor(e, self._placeholders[e.name])

    def _make_pre_hook(self, index: int) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if index in self._passed:
                return  # no rank runs it this forward: its caller does not compute it either
            self._bind(index, self._acquire(index))

        return pre_hook

    def _make_post_hook(self, index: int) -> Any:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            if index in self._passed:
                self._passed.discard(index)
                return
            assert self._bound is not None and self._bound[0] == index
            slot = self._bound[1]
            self._unbind(self._layouts[index])
            self._bound = None
            self._release(index, slot)

        return post_hook

    def _make_layer_hooks(self, lu: _LayerUpcast) -> list[RemovableHandle | _InstanceForward]:
        """Hooks that upcast the cast tensors of ``lu.layer`` (of block ``lu.index``) from the
        bound slot into their region of the compute buffer just before the layer runs, and bind
        them only for its forward: a read of them anywhere else finds a meta tensor and fails,
        rather than reading another layer's values. A Linear whose weight goes in row chunks
        computes through `_chunked_linear` instead of its own forward."""
        index, layer, plan = lu.index, lu.layer, lu.plan
        buf = self._compute_buf
        assert buf is not None
        views = [_view(u.entry, buf, u.offset) for u in plan]
        name = (plan[0] if plan else typed(RowChunks, lu.chunks).upcast).entry.name

        def pre_hook(module: nn.Module, args: Any) -> None:
            bound = self._bound
            if bound is None or bound[0] != index:
                raise RuntimeError(f"{name} ran outside its block's forward, "
                                   "where its weights are not bound")
            # On the compute stream, after the layer before it (which read this region).
            upcast(plan, self._slots[bound[1]], buf)
            for u, view in zip(plan, views, strict=True):
                _set_tensor(u.entry, view)

        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            for u in plan:
                _set_tensor(u.entry, self._placeholders[u.entry.name])

        hooks: list[RemovableHandle | _InstanceForward] = [
            layer.register_forward_pre_hook(pre_hook),
            layer.register_forward_hook(post_hook)]
        if lu.chunks is not None:
            hooks.append(self._chunked_linear(typed(nn.Linear, layer), lu.chunks, buf))
        return hooks

    def _chunked_linear(self, linear: nn.Linear, chunks: RowChunks,
                        buf: torch.Tensor) -> _InstanceForward:
        """Give ``linear`` a forward that upcasts its weight ``chunks.rows`` output rows at a
        time into the region ``chunks`` names and computes those output features from each
        chunk (its bias is bound whole by the layer's pre-hook). Matrix kernels sum every
        output over the same inputs in the same order whatever columns they are asked for, so
        the output equals the whole layer's bit for bit (tests/runtime/test_weights_dtype.py);
        only on the CPU (`_chunk_bytes`), where the buffer is host memory."""
        u, rows = chunks.upcast, chunks.rows
        e = u.entry
        region = buf[u.offset : u.offset + rows * (e.nbytes // e.shape[0])]
        weight = region.view(e.dtype).view(rows, *e.shape[1:])

        def forward(x: torch.Tensor) -> torch.Tensor:
            bound = self._bound
            assert bound is not None  # the pre-hook has checked
            src, bias = self._slots[bound[1]], linear.bias
            out: torch.Tensor | None = None
            for start in range(0, e.shape[0], rows):
                stop = min(start + rows, e.shape[0])
                part = weight[: stop - start]
                upcast_rows(u, src, part, start, stop)
                y = F.linear(x, part, None if bias is None else bias[start:stop])
                if out is None:
                    out = y.new_empty(*y.shape[:-1], e.shape[0])
                out[..., start:stop] = y
            assert out is not None
            return out

        linear.forward = forward  # type: ignore[method-assign, assignment]
        return _InstanceForward(linear)

    # ---- public -------------------------------------------------------------------------

    def idle_forward(self) -> None:
        """Take part in one forward's worth of gathers without computing.

        A rank with no work calls this once for every forward the other ranks run, so their
        collectives find a partner. Resident blocks take no part; with every block resident this
        does nothing.
        """
        for lay in self._streamed:
            slot = self._acquire(lay.index)
            self._release(lay.index, slot)

    def hold_after(self, index: int | None) -> None:
        """Start a forward whose rest the group decides after block ``index``: acquiring that
        block starts no prefetch (of a block the group may not run), until `end_forward`. A
        resident ``index`` holds nothing: the prefetch in flight then is the first streamed
        block, which the next forward needs whatever the decision. Every rank of the group calls
        it before the same forwards. None: forwards run whole again (what a forward that raised
        part-way left held or passed over is forgotten)."""
        self._passed.clear()
        self._hold_index = index if index is not None and index >= self._num_resident else None
        self._held_slot = None

    def leave_when(self, check: Callable[[], bool] | None, *,
                   within_blocks: bool = False, late: bool = False) -> None:
        """Until called again with None, the group may leave a forward between two of its
        blocks: as each streamed block is acquired, every rank of the weight group calls
        ``check``, and the group agrees on the answers (an all-reduce queued behind the next
        block's prefetch, as `agree_any`); if any rank's was true, every rank raises
        `ForwardLeft` as it comes to acquire its next block (the next forward's first, after a
        forward's last; after the step's last, none: with ``within_blocks`` a rank still
        computing that block leaves it, the others' steps are done, and no gather is owed
        either way). The block gathered for it
        then is wasted, and the next forward's first block is fetched without overlap
        (``_acquire``'s out-of-order path); `idle_until` owes nothing for the forward left.
        Every rank of the group sets and clears it for the same forwards, and a forward it
        leaves must not run on (the caller takes its step again).

        ``within_blocks``: a rank computing a block leaves it as soon as the answer is in, at
        the next module inside it, rather than at the next block: the answer comes with the
        next block's gather, early in this one, so the forward is left in about the time from
        the check to the block's end, not one block more. Only where nothing inside a block is
        a collective (no sequence parallelism): a rank leaving it early must not leave a peer
        waiting in one.

        ``late``: this rank's check is the one that changes (rank 0's, which watches the queue;
        the others' are constant): it is looked at until most of the block's time has passed
        (`_leave_flag`), so the forward is left soon after the check turns true, wherever in
        the block that happens."""
        self._leave_check = check
        self._leave_within = within_blocks and check is not None
        self._leave_late = late and check is not None
        if check is None:
            # The last vote of a step, if unread, is moot: no rank gathers anything after it.
            self._left = False
            self._leave_vote = None
            self._want_vote()
        if self._leave_within and not self._within_hooks:
            self._within_hooks = True
            for mod in self.block_modules[self._num_resident:]:
                self._hooks.extend(sub.register_forward_pre_hook(self._leave_inside)
                                   for sub in mod.modules() if sub is not mod)

    def _leave_inside(self, module: nn.Module, args: Any) -> None:
        """Before each module inside a streamed block, with ``within_blocks``: the group's
        answer to the check made as this block was acquired, once it is in."""
        vote = self._leave_vote
        if not self._leave_within or vote is None or not vote.done():
            return
        self._leave_vote = None
        if vote.result():
            self._left = True
            raise ForwardLeft("the group left the forward inside a block")

    @property
    def left(self) -> bool:
        """Whether the group left the forward under way or last run (`leave_when`)."""
        return self._left

    def agree_any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank of the weight group: one all-reduce (MAX) of one
        int, on the transfer thread, so that it takes its place after the gathers already
        issued, in the same order on every rank. This rank's own flag where the blocks are not
        gathered across ranks (each rank streams and decides alone)."""
        return self._vote(lambda: flag).result()

    def _vote(self, flag: Callable[[], bool]) -> cf.Future[bool]:
        """`agree_any`'s answer, to come: the all-reduce queued on the transfer thread, of
        ``flag()`` as the thread comes to it."""
        if not self.gathers:
            done: cf.Future[bool] = cf.Future()
            done.set_result(flag())
            return done

        def reduce() -> bool:
            device = (torch.device("cpu") if str(dist.get_backend(self._group)) == "gloo"
                      else self.platform.device)
            mine = flag()
            with self.platform.use_stream(self._side_stream):
                flags = torch.tensor([int(mine)], dtype=torch.int32, device=device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
                return bool(flags.item())

        return self._executor.submit(reduce)

    def end_forward(self, after: int, run_rest: bool) -> None:
        """The group's decision for the forward `hold_after` started, taken after block
        ``after``: ``run_rest``, prefetch the next block as usual; else the forward's remaining
        streamed blocks are neither gathered nor copied (their hooks do nothing, and the block
        modules must not compute), and the next forward's first streamed block is prefetched
        unless it is in flight already."""
        held = self._held_slot
        self._hold_index = self._held_slot = None
        if run_rest:
            if held is not None:
                self._prefetch(self._next(after), slot=1 - held)
            return
        self._passed = {lay.index for lay in self._streamed if lay.index > after}
        if held is not None:
            self._prefetch(self._num_resident, slot=1 - held)

    @property
    def num_blocks(self) -> int:
        """All blocks of the block lists, resident and streamed."""
        return len(self._layouts)

    @property
    def resident_blocks(self) -> int:
        """Blocks kept on the device for the life of the handle: the first k in streaming order."""
        return self._num_resident

    @property
    def streamed_blocks(self) -> int:
        """Blocks acquired per forward: those that stream through the slots."""
        return len(self._streamed)

    @property
    def gathers(self) -> bool:
        """Whether a forward gathers blocks across ranks (allgather mode with blocks that
        stream): then every rank of the weight group must run the same forwards, in step."""
        return self.config.use_allgather and self.config.world_size > 1 and bool(self._streamed)

    @property
    def num_acquired(self) -> int:
        """Blocks acquired so far; equal on every rank at every step boundary."""
        return self._num_acquired

    def idle_until(self, num_acquired: int) -> None:
        """Take part in gathers, without computing, until ``num_acquired`` blocks were acquired.

        After a forward raised part-way, this issues the gathers it did not, so the other ranks'
        forwards still find a partner for every block.
        """
        if not self._streamed or self._left:
            # Every block is resident: nothing is acquired, nothing to gather. Or every rank
            # left the forward at the same block (`leave_when`): none waits for a partner.
            return
        while self._num_acquired < num_acquired:
            if len(self._inflight) != 1:
                # Exactly one prefetch is in flight between blocks, unless a gather failed
                # under this rank: a peer has left, and no gather can complete any more.
                raise RuntimeError("the group lost a peer: no block gather is in flight")
            (index,) = self._inflight
            self._release(index, self._acquire(index))

    def weight_figures(self) -> dict[str, int]:
        """What this handle keeps of the model's weights, without waiting on the device: the
        blocks, how many stay resident, the device bytes their buffers take (the resident
        blocks, the two slots and the compute buffer), the model's own size (its blocks,
        unsharded, and the tensors kept resident beside them) and its blocks' size as they
        are kept and moved (``stored_block_bytes``, unsharded: ``weights_dtype``'s). Numbers
        only, so that a pipeline's handles add up."""
        return {"num_blocks": len(self._layouts), "resident_blocks": self._num_resident,
                "device_weight_buffer_bytes": self._buffer_bytes(),
                "model_bytes": self._resident_bytes + sum(lay.padded_bytes
                                                          for lay in self._layouts),
                "stored_block_bytes": sum(st.padded_bytes for st in self._stored)}

    def stored_sizes(self, weights_dtype: str) -> dict[str, int]:
        """What this model's blocks would take kept in ``weights_dtype`` (this handle's shard
        count), without building anything: all blocks unsharded, the largest (a slot), and the
        compute buffer a cast streamed block needs (0 when nothing is cast)."""
        check_weights_dtype(weights_dtype)
        stored = [stored_layout(lay, weights_dtype, self.config.shard_count)
                  for lay in self._layouts]
        return {"block_bytes": sum(st.padded_bytes for st in stored),
                "max_block_bytes": max(st.padded_bytes for st in stored),
                "compute_buffer_bytes": _upcast_plans(self._layouts, stored,
                                                      _chunk_bytes(self.platform))[2]}

    @property
    def bytes_moved(self) -> tuple[int, int]:
        """(bytes this rank copied into block buffers, bytes of the blocks its all-gathers
        rebuilt), set-up included: what a step moved is their growth over the step. Each
        transfer reports the bytes it moved, in the dtype the blocks are stored in, and they
        are added when its block is acquired (a prefetch still in flight counts in the step
        that uses it)."""
        with self._lock:
            return self._bytes_copied, self._bytes_gathered

    def stats(self) -> dict[str, Any]:
        if self._timing_events:
            self.platform.synchronize()
            with self._lock:
                for kind, start, end in self._timing_events:
                    self._add_seconds(kind, self.platform.event_elapsed_seconds(start, end))
                self._timing_events = []
        host_bytes = (
            self._slab.numel() if self._slab is not None
            else self._staging.numel() if self._staging is not None else 0
        )
        resident_block_bytes = sum(lay.padded_bytes for lay in self._layouts[: self._num_resident])
        return {
            "num_blocks": len(self._layouts),
            "max_block_bytes": self._max_block_bytes,
            "device_weight_buffer_bytes": self._buffer_bytes(),
            "resident_bytes": self._resident_bytes,
            "resident_blocks": self._num_resident,
            "resident_block_bytes": resident_block_bytes,
            "num_gathers": self._num_gathers,
            "host_shard_bytes": host_bytes,
            "shard_count": self.config.shard_count,
            "gather_seconds": self._gather_seconds,
            "wait_seconds": self._wait_seconds,
            "mode": "allgather" if self.config.use_allgather else "rank-local",
            "mapped_blocks": self._num_resident if self._mapped else 0,
            "weights_dtype": self.weights_dtype,
            "block_bytes": sum(lay.padded_bytes for lay in self._layouts),
            "stored_block_bytes": sum(st.padded_bytes for st in self._stored),
            "max_stored_block_bytes": max(st.padded_bytes for st in self._stored),
            "compute_buffer_bytes": self._compute_bytes,
            "bytes_copied": self._bytes_copied,
            "bytes_gathered": self._bytes_gathered,
        }

    def _buffer_bytes(self) -> int:
        """Bytes of this rank's own block buffers: the resident blocks' (none when they are
        the checkpoint's mapping), the two slots and the compute buffer."""
        resident = 0 if self._mapped else sum(
            lay.padded_bytes for lay in self._layouts[: self._num_resident])
        return resident + 2 * self._max_streamed_bytes + self._compute_bytes

    def close(self) -> None:
        """Release the slots, the host slab, the hooks and the weight group."""
        if self._closed:
            return
        self._want_vote()
        for _, fut in self._inflight.values():
            fut.result()
        self._inflight.clear()
        self._executor.shutdown(wait=True)
        self.platform.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._views.clear()
        self._slots = []
        self._compute_buf = None
        for lay in self._layouts[: self._num_resident]:
            self._unbind(lay)  # the resident blocks' device buffers go with the handle
        self._resident_bufs = []
        self._shards = []
        for buf in (self._slab, self._staging):
            if buf is not None:
                self.platform.release_host(buf)
        self._slab = self._staging = None
        self._source.model_tensors.clear()
        if self._source.checkpoint is not None:
            self._source.checkpoint.close()
        if self._owns_group:
            dist.destroy_process_group(self._group)
        self._group = None
        self._closed = True


def _upcast_plans(layouts: Sequence[BlockLayout], stored: Sequence[BlockLayout],
                  chunk_bytes: int | None = None) -> tuple[
        dict[int, tuple[Upcast, ...]], list[_LayerUpcast], int]:
    """How the cast blocks among ``layouts`` (kept as ``stored``) are upcast: per block, the
    tensors upcast when it is bound, packed from the compute buffer's start; per leaf layer (a
    module without submodules: a Linear, a norm), its block, itself and its own tensors, packed
    after the largest of those, with, given ``chunk_bytes``, an ``nn.Linear``'s weight larger
    than that taken in row chunks of at most that size (`RowChunks`) after the others; and the
    compute buffer's size."""
    upcasts: dict[int, tuple[Upcast, ...]] = {}
    by_layer: dict[nn.Module, tuple[int, list[Upcast]]] = {}
    rest_bytes = 0
    for lay, st in zip(layouts, stored, strict=True):
        if st is lay:
            continue
        rest: list[Upcast] = []
        for u in upcast_plan(lay, st)[0]:
            owner = u.entry.module
            if next(owner.children(), None) is None:
                by_layer.setdefault(owner, (lay.index, []))[1].append(u)
            else:
                rest.append(u)
        upcasts[lay.index], size = packed(rest)
        rest_bytes = max(rest_bytes, size)
    layers = []
    compute_bytes = rest_bytes
    for owner, (index, ups) in by_layer.items():
        weight = next((u for u in ups if u.entry.attr == "weight"), None)
        chunked = (chunk_bytes is not None and type(owner) is nn.Linear and weight is not None
                   and chunk_rows(weight.entry, chunk_bytes) < weight.entry.shape[0])
        whole = [u for u in ups if not chunked or u is not weight]
        plan, end = packed(whole, base=rest_bytes)
        chunks = None
        if chunked:
            assert weight is not None
            rows = chunk_rows(weight.entry, chunk_bytes or 0)
            chunks = RowChunks(replace(weight, offset=end), rows)
            end = _round_up(end + rows * (weight.entry.nbytes // weight.entry.shape[0]),
                            ALIGN_BYTES)
        layers.append(_LayerUpcast(index, owner, tuple(plan), chunks))
        compute_bytes = max(compute_bytes, end)
    return upcasts, layers, compute_bytes


def _chunk_bytes(platform: Platform) -> int | None:
    """The row-chunk bound for cast Linear weights (`_upcast_plans`): `UPCAST_CHUNK_BYTES` on
    the CPU, none on an accelerator, whose compute buffer is device memory and whose matrix
    kernels are chosen by shape."""
    return None if platform.is_accelerator else UPCAST_CHUNK_BYTES


class _InstanceForward:
    """Takes a forward set on one module instance off again (``remove``, as a hook handle)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


@dataclass(frozen=True, slots=True)
class _LayerUpcast:
    """A leaf layer of streamed cast block ``index``: its cast tensors upcast whole just before
    it runs (``plan``), and its weight in row chunks instead where ``chunks`` says so."""

    index: int
    layer: nn.Module
    plan: tuple[Upcast, ...]
    chunks: RowChunks | None


def _make_views(lay: BlockLayout, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each tensor of block ``lay`` as a view into ``buf``, the block's flat byte buffer."""
    return {e.name: _view(e, buf, e.offset) for e in lay.entries}


def _view(e: Entry, buf: torch.Tensor, offset: int) -> torch.Tensor:
    """Tensor ``e`` as a view into flat byte buffer ``buf`` at ``offset``."""
    t = buf[offset : offset + e.nbytes].view(e.dtype).view(e.shape)
    return nn.Parameter(t, requires_grad=False) if e.is_param else t


def _set_tensor(e: Entry, t: torch.Tensor) -> None:
    if e.is_param:
        e.module._parameters[e.attr] = typed(nn.Parameter, t)  # _view and _placeholder make one
    else:
        e.module._buffers[e.attr] = t


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)


# Dedicated gather groups over a caller's subgroup, one per (ranks, backend), kept for the life of
# the process: a locally synchronised group is named by a hash of its ranks, so a second one over
# the same ranks would find the first one's stale addresses in the store.
_SUBGROUP_GATHER_GROUPS: dict[tuple[tuple[int, ...], str], Any] = {}


def _weight_group(group: Any, backend: str) -> tuple[Any, bool, int, int]:
    """(dedicated weight-gather group or None, whether the handle owns it, rank, size)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None, False, 0, 1
    whole_world = group is None or group is dist.group.WORLD
    ranks = (list(range(dist.get_world_size())) if whole_world
             else dist.get_process_group_ranks(group))
    if len(ranks) == 1:
        return None, False, 0, 1
    # A group of its own, so the gathers never interleave with the caller's collectives.
    if whole_world:
        wgroup = dist.new_group(ranks=ranks, backend=backend)
        return wgroup, True, dist.get_rank(wgroup), len(ranks)
    key = (tuple(ranks), backend)
    if key not in _SUBGROUP_GATHER_GROUPS:
        # Only the subgroup's members call apply_dlo, so only they may take part in creating it.
        _SUBGROUP_GATHER_GROUPS[key] = dist.new_group(ranks=ranks, backend=backend,
                                                     use_local_synchronization=True)
    wgroup = _SUBGROUP_GATHER_GROUPS[key]
    return wgroup, False, dist.get_rank(wgroup), len(ranks)


def _agree(group: Any, error: str | None, digest: str, resident_blocks: int = 0) -> int:
    """Raise the same ValueError on every rank if any rank failed or the layouts differ; else
    return the fewest resident blocks any rank asked for (free memory differs between ranks)."""
    if group is None:
        if error:
            raise ValueError(error)
        return resident_blocks
    results: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(results, (error, digest, resident_blocks), group=group)
    failures: dict[str, list[int]] = {}
    for rank, (err, _, _) in enumerate(results):
        if err:
            failures.setdefault(err, []).append(rank)
    if failures:
        raise ValueError("; ".join(f"rank(s) {','.join(map(str, r))}: {msg}"
                                   for msg, r in failures.items()))
    digests = [d for _, d, _ in results]
    if len(set(digests)) > 1:
        raise ValueError("the shard layouts differ across ranks (layout digest per rank: "
                         f"{digests}); every rank must build the same model with the same "
                         "dtypes and block lists")
    return min(k for _, _, k in results)


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")


def _resident_count(layouts: list[BlockLayout], stored: list[BlockLayout],
                    resident_blocks: int | None, device_budget_bytes: int | None) -> int:
    """How many leading blocks stay resident: ``resident_blocks`` (clamped to the block count)
    if given; else the most whose bytes (in the compute dtype), plus two slots for the largest
    block still streamed as stored and a compute buffer for the largest cast one, fit in
    ``device_budget_bytes`` (every block, and no slot, if all of them fit); else 0."""
    n = len(layouts)
    if resident_blocks is not None:
        return min(resident_blocks, n)
    if device_budget_bytes is None:
        return 0
    # suffix_slot[k] / suffix_up[k]: the slot and compute buffer sizes when k are resident.
    suffix_slot = [0] * (n + 1)
    suffix_up = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_slot[i] = max(stored[i].padded_bytes, suffix_slot[i + 1])
        upcast_bytes = upcast_plan(layouts[i], stored[i])[1] if stored[i] is not layouts[i] else 0
        suffix_up[i] = max(upcast_bytes, suffix_up[i + 1])
    prefix = [0]
    for lay in layouts:
        prefix.append(prefix[-1] + lay.padded_bytes)
    for k in range(n, 0, -1):
        if prefix[k] + 2 * suffix_slot[k] + suffix_up[k] <= device_budget_bytes:
            return k
    return 0


def apply_dlo(
    model: nn.Module,
    *,
    checkpoint: CheckpointSpec | None = None,
    blocks: Sequence[str] | None = None,
    group: Any = None,
    use_allgather: bool = True,
    device: torch.device | str | None = None,
    resident_blocks: int | None = None,
    device_budget_bytes: int | None = None,
    weights_dtype: str = "checkpoint",
) -> DLOHandle:
    """Stream ``model``'s block lists through two device slots; see the module docstring.

    Args:
        model: materialised on the CPU, or built on the meta device when ``checkpoint`` is given.
        checkpoint: a safetensors file, a directory of them, or a list of files, keyed by the
            model's ``state_dict()`` names; read through shared memory maps.
        blocks: dotted paths of the ModuleLists to stream; None finds them.
        group: the process group sharing the weights; None is the default group when
            torch.distributed is initialised, else this process alone.
        use_allgather: shard the weights across the group (False: rank-local streaming).
        device: where the forward runs; default the current accelerator, else the CPU.
        resident_blocks: keep the first k blocks in streaming order on the device for the life
            of the handle (clamped to the number of blocks); the rest stream.
        device_budget_bytes: when ``resident_blocks`` is None, device bytes for block weights
            (resident blocks plus the two slots; non-block tensors are not counted): keep as
            many leading blocks resident as fit. Every rank of the group uses the fewest
            resident blocks any rank's arguments give. Default (neither): every block streams.
        weights_dtype: ``checkpoint`` (the blocks as the model has them), ``bf16`` or ``fp8``:
            the dtype the host copy, the slots and the transfers hold the blocks in, cast once
            here and upcast into the model's dtype before each block's forward
            (``runtime.dlo.cast``). Every rank of the group must pass the same.
    """
    platform = get_platform(device)
    block_lists = _resolve_block_lists(model, blocks)
    wgroup, owns_group, rank, world = _weight_group(group, platform.backend)
    if world == 1 and not platform.is_accelerator:
        # Nothing to gather, and host memory is the device: stream from the source itself (the
        # shared checkpoint mapping) instead of keeping a private copy of every block.
        use_allgather = False
    shard_count = world if use_allgather else 1
    config = DLOConfig(use_allgather=use_allgather, rank=rank, shard_count=shard_count,
                       world_size=world)

    error: str | None = None
    layouts: list[BlockLayout] = []
    stored: list[BlockLayout] = []
    modules: list[nn.Module] = []
    ckpt: Checkpoint | None = None
    source = _Source(None)
    resident_bytes = 0
    num_resident = 0
    try:
        _check_count("resident_blocks", resident_blocks)
        _check_count("device_budget_bytes", device_budget_bytes)
        check_weights_dtype(weights_dtype)
        for path, blist in block_lists:
            for i, block in enumerate(blist):
                layouts.append(build_layout(len(layouts), f"{path}.{i}", block, shard_count))
                modules.append(block)
        stored = [stored_layout(lay, weights_dtype, shard_count) for lay in layouts]
        num_resident = _resident_count(layouts, stored, resident_blocks, device_budget_bytes)
        streamed = {e.name for lay in layouts for e in lay.entries}
        block_ids = {id(t) for path, blist in block_lists
                     for _, _, _, _, t in block_tensors(path, blist)}
        # Tied tensors have several names; a checkpoint usually stores only one of them.
        names_by_id: dict[int, list[str]] = {}
        tensors_by_id: dict[int, torch.Tensor] = {}
        for n, t in model.state_dict(keep_vars=True).items():
            if n not in streamed and id(t) not in block_ids:
                names_by_id.setdefault(id(t), []).append(n)
                tensors_by_id[id(t)] = t
        resident = [(tuple(names_by_id[i]), tensors_by_id[i]) for i in names_by_id]
        wanted = [((e.name,), torch.empty(e.shape, dtype=e.dtype, device="meta"))
                  for lay in layouts for e in lay.entries] + resident
        if checkpoint is not None:
            ckpt = Checkpoint.open(checkpoint)
            problems = _check_against_checkpoint(wanted, ckpt)
            if problems:
                error = "; ".join(problems)
        else:
            on_meta = [names[0] for names, t in resident if t.is_meta] + [
                e.name for lay in layouts for e in lay.entries if _current(e).is_meta
            ]
            if on_meta:
                error = (f"{len(on_meta)} tensor(s) are on the meta device (e.g. {on_meta[0]!r}) "
                         "and no checkpoint was given to load them from")
        if error is None:
            source = _Source(ckpt)
            resident_bytes = _place_resident(model, platform.device, ckpt, streamed, block_ids,
                                             names_by_id)
            if ckpt is None:
                source.model_tensors = {
                    e.name: _bytes_of(_current(e)) for lay in layouts for e in lay.entries
                }
    except ValueError as exc:
        error = str(exc)
    digest = layout_digest(layouts, shard_count)
    if weights_dtype != "checkpoint":  # the ranks must store (and so gather) the same bytes
        digest += f":{weights_dtype}"
    try:
        num_resident = _agree(wgroup, error, digest, num_resident)
    except ValueError:
        if ckpt is not None:
            ckpt.close()
        if owns_group:
            dist.destroy_process_group(wgroup)
        raise
    if num_resident:
        log.info("DLO: %d of %d blocks resident on the device", num_resident, len(layouts))
    if shard_count > 1 and not platform.is_accelerator and num_resident < len(stored):
        # gloo allocates every gathered block anew: see `hostmem.map_blocks_on_their_own`.
        hostmem.map_blocks_on_their_own(min(st.padded_bytes for st in stored[num_resident:]))
    return DLOHandle(model, layouts, modules, config=config, platform=platform, group=wgroup,
                     owns_group=owns_group, source=source, resident_bytes=resident_bytes,
                     resident_blocks=num_resident, stored=stored, weights_dtype=weights_dtype)


def _current(e: Entry) -> torch.Tensor:
    table = e.module._parameters if e.is_param else e.module._buffers
    return typed(torch.Tensor, table[e.attr])  # build_layout found it set


def _place_resident(model: nn.Module, device: torch.device, ckpt: Checkpoint | None,
                    streamed: set[str], block_ids: set[int],
                    names_by_id: dict[int, list[str]]) -> int:
    """Put every non-block tensor on the device (from the checkpoint when given); return bytes."""
    total = 0
    placed: dict[int, torch.Tensor] = {}  # id(original) -> placed value, to keep tied tensors tied
    for mod_name, mod in model.named_modules():
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for attr, t in list(table.items()):
                if t is None or id(t) in block_ids:
                    continue
                if id(t) in placed:
                    table[attr] = placed[id(t)]
                    continue
                name = f"{mod_name}.{attr}" if mod_name else attr
                if name in streamed:
                    continue
                stored = next((n for n in names_by_id.get(id(t), [name])
                               if ckpt is not None and n in ckpt), None)
                if ckpt is not None and stored is not None:
                    value = ckpt.tensor(stored)
                elif t.is_meta:
                    raise ValueError(f"tensor {name!r} is on the meta device and is not in the "
                                     "checkpoint (a non-persistent buffer must be materialised "
                                     "before apply_dlo)")
                else:
                    value = t.detach()
                # On the CPU, .to() returns the same tensor: mmap-backed values stay shared.
                value = value.to(device)
                total += value.numel() * value.element_size()
                new = nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value
                placed[id(t)] = table[attr] = new
    return total

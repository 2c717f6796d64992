"""Step caching: a forward skips its remaining blocks when its first block's output has hardly
changed since the last step that ran them, and the ranks of a DLO group agree which blocks they
gather.

The rule is diffusers' first-block cache (``FirstBlockCacheConfig``), operation for operation:
the first block runs; its residual (output minus input) is compared with the residual of the
last forward that ran every block, ``mean|r - r_prev| / mean|r_prev|``; above the job's
threshold (or with nothing to compare with) the rest runs and the forward keeps the first block's
output and residual and the rest's residual (last block's output minus first block's); at or
below it, the rest is skipped and the kept residual of the rest is added to the first block's
output. One state per job, transformer and forward of a step: the conditional and unconditional
forwards of a two-forward step keep their own, as diffusers' ``cache_context("cond")`` and
``("uncond")`` do; a batch-2 guidance pair is one forward and decides once for both halves.

Why not diffusers' hooks themselves: they compose with DLO (its hooks sit on the blocks'
``__call__``, diffusers' replace their ``forward``), but a skipped block is still acquired, so
every block is still gathered, and each rank decides alone. Here every rank of the group, with a
job or idle, reaches the decision after the first block of every forward of a step in which any
rank's job caches (`runtime.pipelines.base.agree_handles` says so, in its one all-reduce): one
more all-reduce (``DLOHandle.agree_any``) tells whether any rank runs the rest. If none does, the
remaining blocks are neither gathered nor copied (``DLOHandle.end_forward``); if one does, a
rank whose job skips joins their gathers without computing, as an idle rank does. A job's frames
are therefore the same whatever the other ranks' jobs, and a group whose jobs are all exact does
no extra work at all.

Not with sequence parallelism: the shards of a replica would each decide on their own tokens.
A request's quality tier names its threshold (``common.quality``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from runtime.dlo import DLOHandle


@dataclass(kw_only=True, slots=True)
class ForwardCache:
    """One forward's state across a job's steps (diffusers' ``FBCSharedBlockState``)."""

    head_residual: torch.Tensor | None = None  # the first block's output minus its input
    head_output: torch.Tensor | None = None  # the first block's output
    rest_residual: torch.Tensor | None = None  # the last block's output minus the first's


_FORWARD_FIELDS = tuple(f.name for f in fields(ForwardCache))


@dataclass(kw_only=True, slots=True)
class JobCache:
    """A job's step cache: its threshold, the state of each of its forwards (keyed by the
    transformer and the forward's place in the step), and what it computed."""

    threshold: float
    forwards: dict[tuple[int, int], ForwardCache] = field(default_factory=dict)
    num_forwards: int = 0  # forwards run
    num_forwards_skipped: int = 0  # of which the rest was taken from the cache
    num_blocks_computed: int = 0

    def figures(self) -> dict[str, int]:
        return {"forwards": self.num_forwards, "forwards_skipped": self.num_forwards_skipped,
                "blocks_computed": self.num_blocks_computed}

    def copy(self) -> JobCache:
        """This cache as it is now: its forwards' tensors are replaced by a step, never changed
        in place, so copies of the forwards keep them."""
        return replace(self, forwards={k: replace(f) for k, f in self.forwards.items()})

    def to_plain(self) -> dict[str, Any]:
        """This cache as strings, numbers and tensors (what a checkpoint holds): a job resumed
        from it decides its next steps as it would have without the interruption."""
        return {"threshold": self.threshold, "num_forwards": self.num_forwards,
                "num_forwards_skipped": self.num_forwards_skipped,
                "num_blocks_computed": self.num_blocks_computed,
                "forwards": {f"{t}.{p}": {n: getattr(f, n) for n in _FORWARD_FIELDS}
                             for (t, p), f in self.forwards.items()}}

    @classmethod
    def from_plain(cls, plain: Any) -> JobCache:
        """The cache `to_plain` wrote; a ValueError saying what does not fit."""
        try:
            forwards = {}
            for key, f in plain["forwards"].items():
                t, p = (int(x) for x in key.split("."))
                forwards[(t, p)] = ForwardCache(**{n: f[n] for n in _FORWARD_FIELDS})
            return cls(threshold=float(plain["threshold"]), forwards=forwards,
                       num_forwards=int(plain["num_forwards"]),
                       num_forwards_skipped=int(plain["num_forwards_skipped"]),
                       num_blocks_computed=int(plain["num_blocks_computed"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a step cache ({type(exc).__name__}: {exc})") from None


def job_cache(threshold: float | None) -> JobCache | None:
    """A job's step cache at ``threshold`` (None: exact, no cache)."""
    if threshold is None:
        return None
    if not threshold >= 0:
        raise ValueError(f"the step cache's threshold must be >= 0, got {threshold}")
    return JobCache(threshold=float(threshold))


def computes_rest(residual: torch.Tensor, previous: torch.Tensor | None,
                  threshold: float) -> bool:
    """diffusers' ``_should_compute_remaining_blocks``: whether the rest of the forward runs."""
    if previous is None:
        return True
    absmean = (residual - previous).abs().mean()
    diff = (absmean / previous.abs().mean()).item()
    return diff > threshold


class StepCache:
    """The first-block cache on one transformer's block list, for every job the pipeline runs.

    The pipeline runs each call of the transformer inside `forward`, steps between `begin_step`
    and `end_step`, and has `complete` issue what a step's forwards did not (an idle rank's, a
    forward not run, one that raised part-way). Every block's ``forward`` is wrapped: outside a
    caching job and a deciding step the wrapper only counts the block and calls it.
    """

    def __init__(self, blocks: nn.ModuleList, handle: DLOHandle | None) -> None:
        if len(blocks) < 2:
            raise ValueError("a step cache needs two blocks at least: a first and a rest")
        self.handle = handle
        self.num_blocks = len(blocks)
        self.num_blocks_computed = 0  # on this rank, every job, since set-up
        self._deciding = False  # this step's forwards end with the group's decision
        self._job: JobCache | None = None  # the caching job whose forward runs now
        self._state: ForwardCache | None = None
        self._runs_rest = True  # whether this rank computes the rest of the current forward
        # Inside a deciding step: where the current forward is ("head": before the decision,
        # "rest": the group runs the rest, None: between forwards), the blocks acquired when it
        # started, and the forwards done.
        self._phase: str | None = None
        self._start = 0
        self.forwards_done = 0
        for i, block in enumerate(blocks):
            block.forward = self._wrap(i, block.forward)

    # ---- the step -------------------------------------------------------------------------

    def begin_step(self, deciding: bool) -> None:
        """``deciding``: some rank's job caches this step (or this rank's, when it decides
        alone), so every forward of it ends with the group's decision."""
        self._deciding = deciding
        self._phase = None
        self.forwards_done = 0

    def end_step(self) -> None:
        self._deciding = False
        self._phase = None
        if self.handle is not None:
            self.handle.hold_after(None)

    @contextlib.contextmanager
    def forward(self, job: JobCache | None, key: tuple[int, int]) -> Iterator[None]:
        """Around one call of the transformer for ``job`` (None: an exact one); ``key``: the
        transformer and the forward's place in the step."""
        self._job = job
        self._state = None if job is None else job.forwards.setdefault(key, ForwardCache())
        self._runs_rest = True
        if self._deciding:
            self._begin_forward()
        try:
            yield
        finally:
            self._job = self._state = None
            self._runs_rest = True
        if self._deciding:
            assert self._phase != "head", "the first block never ran"
            self._phase = None
            self.forwards_done += 1

    def idle_forward(self) -> None:
        """One forward's gathers, computing nothing (a rank without a job, a forward its job
        does not run)."""
        if not self._deciding:
            if self.handle is not None:
                self.handle.idle_forward()
            self.forwards_done += 1
            return
        self._begin_forward()
        self._finish_forward()

    def complete(self, forwards: int) -> None:
        """Issue, without computing, what this step's forwards have not: the rest of one that
        raised part-way, then whole forwards until ``forwards`` are done."""
        if self._phase is not None:
            self._finish_forward()
        while self.forwards_done < forwards:
            self.idle_forward()

    def _begin_forward(self) -> None:
        self._phase = "head"
        if self.handle is not None:
            self._start = self.handle.num_acquired
            self.handle.hold_after(0)

    def _finish_forward(self) -> None:
        """The current forward to its end, computing nothing more on this rank."""
        handle = self.handle
        if self._phase == "head":
            if handle is not None and handle.resident_blocks == 0:
                handle.idle_until(self._start + 1)  # the first block, if not acquired yet
            self._decide(False)
        if self._phase == "rest" and handle is not None:
            handle.idle_until(self._start + handle.streamed_blocks)
        self._phase = None
        self.forwards_done += 1

    def _decide(self, runs_rest: bool) -> bool:
        """After the first block: whether any rank of the group runs the rest; sets up the
        gathers of the rest, or drops them."""
        self._runs_rest = runs_rest
        run = runs_rest
        if self.handle is not None:
            run = self.handle.agree_any(runs_rest)
            self.handle.end_forward(0, run)
        self._phase = "rest" if run else "skipped"
        return run

    # ---- the blocks ---------------------------------------------------------------------

    def _wrap(self, index: int, forward: Any) -> Any:
        last = self.num_blocks - 1

        def cached_forward(*args: Any, **kwargs: Any) -> Any:
            if index == 0:
                return self._first(forward, args, kwargs)
            if not self._runs_rest:
                # The cache's residual was added after the first block; the blocks pass it on.
                # (If another rank runs them, their gathers were issued by the DLO hooks.)
                return args[0]
            out = forward(*args, **kwargs)
            self._computed()
            if index == last and self._state is not None:
                assert self._state.head_output is not None
                self._state.rest_residual = out - self._state.head_output
            return out

        return cached_forward

    def _computed(self) -> None:
        self.num_blocks_computed += 1
        if self._job is not None:
            self._job.num_blocks_computed += 1

    def _first(self, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = forward(*args, **kwargs)
        self._computed()
        job, state = self._job, self._state
        runs_rest = True
        if job is not None and state is not None:
            job.num_forwards += 1
            residual = out - args[0]
            runs_rest = computes_rest(residual, state.head_residual, job.threshold)
            if runs_rest:
                state.head_output, state.head_residual = out, residual
            else:
                assert state.rest_residual is not None
                out = state.rest_residual + out
                job.num_forwards_skipped += 1
        if self._deciding:
            self._decide(runs_rest)
        else:
            self._runs_rest = runs_rest
        return out

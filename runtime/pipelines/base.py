"""The pipeline contract: a denoising loop that the caller drives one step at a time.

Every pipeline offers

- ``state = pipe.prepare(request)``: text encoding, initial noise, the schedule. Local work only:
  no collective and no forward of a DLO-streamed transformer.
- ``pipe.handles_needed(state)``: per streamed transformer (``pipe.handles``), whether the job's
  next step runs it (the expert of a two-transformer model its timestep falls on).
- ``active = agree_handles(pipe, state)``, on every rank of the group before every step: the
  union of the ranks' needs (an all-reduce; an idle rank needs nothing).
- ``pipe.step(state, active)``: one denoising step. Every active transformer acquires **exactly**
  ``pipe.forwards_per_step`` forwards' worth of blocks: the gathers of a forward the job does not
  need (no classifier-free guidance in a pipeline that runs the pair as two forwards, the expert
  another rank needs), or that a forward which raised part-way never reached, are issued without
  computing (``handle.idle_until``) before ``step`` returns or re-raises. A transformer that is not
  active is neither run nor gathered; ``active=None`` means all of them.
- ``pipe.idle_step(active)``: the same gathers for a rank that has no job this step.
- ``pipe.decode(state)``: float frames ``[N, H, W, 3]`` in [0, 1] (request-tiled, see
  ``runtime.tiling``).
- ``pipe.preview(state)``, only where ``pipe.can_preview``: one uint8 frame of the current
  estimate of the clean video, cheap enough to take every few steps while the job runs. Local
  work (no collective, no streamed transformer) that leaves ``state`` as it was, so the rendered
  video is the same with or without previews.
- ``pipe.resume_tensors(state)``, ``pipe.resume_values(state)``: what a step changed (the
  latents, the step index, the schedulers' and generators' state, the entries of ``state.extra``
  named in ``resume_keys``), as tensors and JSON values; ``pipe.load_resume(state, tensors,
  values)`` puts them back into a state fresh from ``prepare``, so the job carries on bit for bit
  (``runtime.resume`` writes and reads them as a checkpoint).

Why: the ranks of a DLO group issue one gather per block per forward, and a gather completes only
when every rank issues it. So between two step boundaries every rank must run the same number of
forwards, whatever its job. Keeping the count fixed per step (not per job) is what lets a worker
admit a new job on one rank at a step boundary while the others carry on, check cancel flags and
report progress between steps, and drive ranks whose jobs have different step counts (a rank
that has finished calls ``idle_step`` until the longest job is done).

For the same reason the classifier-free-guidance pair is never tiled by free memory into a
varying number of forwards: free memory differs across ranks, and so would the forward counts.
Every family runs the pair as one batch-2 forward (conditional and unconditional stacked on the
batch axis), so each block is gathered once per step and computes both branches while it sits in
its slot; a request without guidance runs a batch-1 forward through the same gathers. kiln-tiny
and Wan keep the two batch-1 forwards of the reference loops as an option (``cfg_batch=False``:
``forwards_per_step`` 2), for comparison.

Which transformers a step gathers is agreed per step, not fixed: a two-expert model (Wan2.2)
gathers only the experts some rank of the group needs at this step, so ranks on the same side
of the boundary gather one expert's blocks, and ranks on either side gather both.

A job may cache steps (``VideoRequest.step_cache``, ``runtime.step_cache``): a forward then runs
its first block and skips the rest when that block's output has hardly changed. The same
all-reduce tells every rank whether any job of the group caches this step; if one does, every
forward of the step (a rank's own, an idle one, one its job does not need) ends after the first
block with the group's decision on the rest, which is gathered only if some rank computes it.
A step is then still ``forwards_per_step`` forwards on every rank, each of one or all blocks.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from common.families import TINY
from common.render import RenderFields
from runtime.adapters import Adapter, use_adapters
from runtime.dlo import DLOHandle, ForwardLeft
from runtime.pipelines import resumable
from runtime.platform import default_device
from runtime.step_cache import JobCache, StepCache, job_cache
from runtime.step_replay import LEFT_STEP, LeftStep, StepLeft, StepReplay


@dataclass(kw_only=True, frozen=True, slots=True, eq=False)
class Conditioning:
    """What a render starts from besides its text: decoded, checked pixels, already fitted to the
    request's size (``storage.media`` decodes and checks an upload; the caller fits it), so a
    pipeline never decodes a file. uint8, channels last, on the CPU. A family takes the inputs
    its ``common.families.Family.inputs`` names and refuses the others."""

    image: torch.Tensor | None = None  # the first frame, [H, W, 3]
    last_image: torch.Tensor | None = None  # the last frame, [H, W, 3] (first/last-frame models)
    video: torch.Tensor | None = None  # a clip to start from, [N, H, W, 3]
    # How far video-to-video moves from ``video``: 1.0 renders from pure noise, 0.0 returns it.
    strength: float | None = None
    # An extension: the clip the render continues, [N, H, W, 3]. The pipeline sees only
    # ``image`` (its last frame); the stored video is these frames, then the rendered ones after
    # their first (which is ``image`` again).
    prefix: torch.Tensor | None = None

    def digest(self) -> str:
        """sha256 (hex) of the pixels and the strength: what a checkpoint of a conditioned job
        must match (``runtime.resume.request_digest``)."""
        h = hashlib.sha256()
        for name in ("image", "last_image", "video", "prefix"):
            t = getattr(self, name)
            h.update(name.encode())
            if t is not None:
                h.update(repr(tuple(t.shape)).encode())
                h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
        h.update(repr(self.strength).encode())
        return h.hexdigest()


@dataclass(kw_only=True, frozen=True, slots=True)
class VideoRequest(RenderFields):
    """One render as the pipelines take it: the render fields (``common.render``), checked. A
    field left out gets kiln-tiny's value (``common.families.TINY``), as `kiln render` does."""

    width: int = TINY.defaults.width
    height: int = TINY.defaults.height
    num_frames: int = TINY.defaults.num_frames
    fps: int = TINY.defaults.fps
    num_inference_steps: int = TINY.defaults.num_inference_steps
    guidance_scale: float = TINY.defaults.guidance_scale
    negative_prompt: str = ""
    seed: int = 0
    # None: text only. Not compared (tensors): a checkpoint compares its digest instead.
    conditioning: Conditioning | None = field(default=None, compare=False)
    # LoRA adapters, loaded (``runtime.adapters.load_adapter``), each with its weight: added to
    # this job's forwards only. Not compared: a checkpoint compares their digests instead.
    adapters: tuple[tuple[Adapter, float], ...] = field(default=(), compare=False)
    # The first-block cache's threshold (``runtime.step_cache``); None: exact, every block of
    # every step computed.
    step_cache: float | None = None

    def __post_init__(self) -> None:
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if self.step_cache is not None and not self.step_cache >= 0:
            raise ValueError(f"step_cache must be a threshold >= 0 or None, got {self.step_cache}")
        if self.width <= 0 or self.height <= 0 or self.num_frames <= 0:
            raise ValueError(f"size and frames must be positive, got {self.width}x{self.height}, "
                             f"{self.num_frames} frames")

    @classmethod
    def of(cls, source: Any, *, conditioning: Conditioning | None = None) -> VideoRequest:
        """The request for a job: its render fields read off ``source`` by name (a job's row, or
        any `RenderFields` with its seed set); no negative prompt is the empty one."""
        values = {f.name: getattr(source, f.name) for f in fields(RenderFields)}
        values["negative_prompt"] = values["negative_prompt"] or ""
        return cls(**values, conditioning=conditioning)


@dataclass(kw_only=True, slots=True)
class DenoiseState:
    request: VideoRequest
    latents: torch.Tensor  # the current noisy latents, fp32
    num_inference_steps: int  # denoising steps this job runs
    step_index: int = 0  # steps done so far
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific: embeddings, scheduler

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_inference_steps


class VideoPipeline(abc.ABC):
    """Base class: enforces the forwards-per-step contract of the module docstring."""

    #: Forwards of each active streamed transformer per step, whatever the job (an instance
    #: may set its own).
    forwards_per_step: int = 1
    #: Whether `preview` is offered: cheap next to a step, and local to the rank.
    can_preview: bool = False
    #: Entries of ``state.extra`` that ``step`` replaces and ``prepare`` cannot rebuild, which
    #: a checkpoint holds beside the latents (`resume_tensors`).
    resume_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, handles: Sequence[DLOHandle | None]) -> None:
        self.handles = list(handles)
        self._step_targets: list[int | None] | None = None  # inside step(): blocks to reach
        # Per entry of ``handles``: its transformer's first-block cache (``runtime.step_cache``);
        # None where the pipeline offers none. A pipeline that offers them installs them.
        self.step_caches: list[StepCache | None] = [None] * len(self.handles)
        self._deciding = False  # inside step(): its forwards end with the group's decision
        # Steps that may be left part-way keep their blocks' outputs (`keep_left_blocks`).
        self._replay: StepReplay | None = None
        self._keeps_left = False
        # What this rank's last step (or idle step) did: the blocks it gathered across ranks
        # and, where the pipeline has step caches, the blocks it computed.
        self.last_step_figures: dict[str, int] = {}
        # What the last step left part-way (`StepLeft`) had computed and does not keep.
        self.last_step_lost_seconds = 0.0

    @abc.abstractmethod
    def prepare(self, request: VideoRequest) -> DenoiseState: ...

    @abc.abstractmethod
    def _denoise(self, state: DenoiseState) -> None:
        """Advance ``state.latents`` by one step, with at most ``forwards_per_step`` forwards
        of each streamed transformer."""

    @abc.abstractmethod
    def decode(self, state: DenoiseState) -> torch.Tensor: ...

    def preview(self, state: DenoiseState) -> torch.Tensor:
        """The middle frame of the current estimate of the clean video, uint8 ``[H, W, 3]`` on
        the CPU; what the estimate is, each pipeline says. Only where ``can_preview``."""
        raise NotImplementedError(f"{type(self).__name__} offers no preview")

    def resume_tensors(self, state: DenoiseState) -> dict[str, torch.Tensor]:
        """The tensors of what ``state``'s steps changed, by name: the latents, the tensors of
        every diffusers scheduler in ``state.extra`` (a multistep one's history of model
        outputs), every torch.Generator's state there, the entries ``resume_keys``, and a
        caching job's step cache (what its next steps decide from). What ``prepare`` builds from
        the request (text embeddings, rotary tables) is not among them.
        """
        return resumable.capture(*self._resumable(state))[0]

    def resume_values(self, state: DenoiseState) -> dict[str, Any]:
        """The rest of what `resume_tensors` saves, as JSON: the step index, the schedulers'
        counters, and where each tensor goes (by its name)."""
        return resumable.capture(*self._resumable(state))[1]

    def load_resume(self, state: DenoiseState, tensors: dict[str, torch.Tensor],
                    values: dict[str, Any]) -> None:
        """Overwrite ``state``, fresh from ``prepare`` for the same request, with what
        `resume_tensors` and `resume_values` saved; ``resumable.IncompatibleCheckpoint``, and
        ``state`` as it was, when they do not fit it (another shape, dtype or scheduler)."""
        keys = self._resumable(state)[1]
        resumable.load(state, keys, tensors, values)
        if STEP_CACHE in keys:
            plain = state.extra.pop(STEP_CACHE)
            if plain is not None:
                try:
                    state.extra[STEP_CACHE] = JobCache.from_plain(plain)
                except ValueError as exc:
                    raise resumable.IncompatibleCheckpoint(f"extra.{STEP_CACHE}: {exc}") from None

    def _resumable(self, state: DenoiseState) -> tuple[DenoiseState, tuple[str, ...]]:
        """``state`` as `resumable` saves it, and the entries of ``state.extra`` it saves: a
        caching job's step cache as plain values (None before its first step) besides
        ``resume_keys``."""
        if state.request.step_cache is None:
            return state, self.resume_keys
        cache = state.extra.get(STEP_CACHE)
        plain = cache.to_plain() if cache is not None else None
        return (replace(state, extra={**state.extra, STEP_CACHE: plain}),
                (*self.resume_keys, STEP_CACHE))

    @property
    def gathers_weights(self) -> bool:
        """Whether its steps gather weights across ranks (a transformer streamed in allgather
        mode): then every rank of the group runs every step, in step, job or no job. Without
        gathers a replica's step is its own (rank-local weights, every block resident)."""
        return any(h is not None and h.gathers for h in self.handles)

    def handles_needed(self, state: DenoiseState) -> list[bool]:
        """Per entry of ``handles``: whether this job's next step runs that transformer."""
        return [True] * len(self.handles)

    def _active(self, active: Sequence[bool] | None) -> list[bool]:
        if active is None:
            return [True] * len(self.handles)
        active = [bool(a) for a in active]
        if len(active) != len(self.handles):
            raise ValueError(f"active names {len(active)} transformers, the pipeline has "
                             f"{len(self.handles)}")
        return active

    def step(self, state: DenoiseState, active: Sequence[bool] | None = None) -> None:
        """One denoising step; ``active``: the transformers the group runs this step (the union
        of its ranks' needs, `agree_handles`; None: all of them). A step that raises leaves the
        job's state as it was before it: the latents change only at its end, and a caching
        job's step cache is put back."""
        if state.done:
            raise ValueError(f"the job has run all its {state.num_inference_steps} steps")
        on = self._active(active)
        before = [None if h is None else h.num_acquired for h in self.handles]
        targets = [None if h is None or not a else
                   h.num_acquired + self.forwards_per_step * h.streamed_blocks
                   for h, a in zip(self.handles, on, strict=True)]
        job = job_cache_of(state)
        deciding = getattr(active, "step_cache", None)
        if deciding is None:  # not agreed: this rank decides alone, if its blocks allow it
            deciding = job is not None and not self.gathers_weights
        self._begin_step(targets, deciding)
        counts = self._counts()
        cache_before = job.copy() if job is not None else None
        left = False
        began = time.perf_counter()
        kept: LeftStep | None = state.extra.pop(LEFT_STEP, None)
        replay = self._replay if self._keeps_left and job is None and not deciding else None
        if replay is not None:
            replay.begin(kept if kept is not None and kept.step_index == state.step_index
                         and kept.active == tuple(on) else None)
        try:
            if job is not None and not deciding:
                raise ValueError("a job that caches steps on ranks that gather weights needs "
                                 "the group's agreement on each step (agree_handles)")
            if job is not None and not any(self.step_caches):
                raise ValueError(f"{type(self).__name__} offers no step cache")
            missing = [i for i, (need, a) in enumerate(
                zip(self.handles_needed(state), on, strict=True)) if need and not a]
            if missing:
                raise ValueError(f"this step needs transformer(s) {missing}, which the group "
                                 f"does not run this step (active={on})")
            with use_adapters(self, state.request.adapters):
                self._denoise(state)
        except BaseException as exc:
            left = isinstance(exc, ForwardLeft)
            if cache_before is not None:
                state.extra[STEP_CACHE] = cache_before
            if isinstance(exc, StepLeft):
                if replay is None:
                    self.last_step_lost_seconds = time.perf_counter() - began
                else:
                    # Left for another job: the blocks computed are kept for the step taken
                    # again.
                    self.last_step_lost_seconds = replay.unkept_seconds
                    state.extra[LEFT_STEP] = LeftStep(
                        step_index=state.step_index, active=tuple(on), outputs=replay.end())
            raise
        finally:
            if replay is not None:
                replay.end()
            # The gathers this job did not need (no CFG, the expert another rank needs), or that
            # a forward which raised part-way never issued: every other rank is waiting for them.
            # None after the group left the step together (`leave_steps_when`).
            try:
                if not left:
                    self._complete_handles_before(len(self.handles))
            finally:
                self._end_step()
                self._count_step(counts)
        for i, (handle, target, start) in enumerate(zip(self.handles, targets, before,
                                                        strict=True)):
            if handle is None:
                continue
            assert start is not None  # counted for every handle
            if target is None and handle.num_acquired != start:
                raise AssertionError(f"{type(self).__name__} ran a transformer that is not "
                                     "active this step")
            cache = self.step_caches[i]
            if deciding and cache is not None:  # forwards of one block or all of them
                ran_over = (cache.forwards_done != self.forwards_per_step
                            or handle.num_acquired > (target or start))
            else:
                ran_over = handle.num_acquired != target
            if target is not None and ran_over:
                raise AssertionError(f"{type(self).__name__} ran more than forwards_per_step="
                                     f"{self.forwards_per_step} forwards in one step")
        state.step_index += 1

    def _counts(self) -> dict[str, int]:
        counts = {"gathers": sum(h.num_acquired for h in self.handles
                                 if h is not None and h.gathers)}
        if any(self.step_caches):
            counts["blocks_computed"] = sum(c.num_blocks_computed for c in self.step_caches
                                            if c is not None)
        return counts

    def _count_step(self, before: dict[str, int]) -> None:
        self.last_step_figures = {k: v - before[k] for k, v in self._counts().items()}

    def _begin_step(self, targets: list[int | None], deciding: bool) -> None:
        self._step_targets = targets
        self._deciding = deciding
        for cache in self.step_caches:
            if cache is not None:
                cache.begin_step(deciding)

    def _end_step(self) -> None:
        self._step_targets = None
        self._deciding = False
        for cache in self.step_caches:
            if cache is not None:
                cache.end_step()

    @contextlib.contextmanager
    def _forward(self, index: int, state: DenoiseState, position: int = 0) -> Iterator[None]:
        """Around one call of transformer ``index`` for ``state``'s job, the ``position``-th
        forward of its step: its step cache's (`runtime.step_cache.StepCache.forward`), where
        the pipeline offers one."""
        cache = self.step_caches[index]
        if cache is None:
            yield
            return
        with cache.forward(job_cache_of(state), (index, position)):
            yield

    def _complete_handles_before(self, index: int) -> None:
        """Finish this step's gathers of handles ``0 .. index-1``.

        A pipeline with several streamed transformers calls this with a transformer's index
        before running it: every rank then finishes the handles in the same order, whichever
        transformer its own job needs this step. (Each handle's gathers run on their own group;
        a rank computing with handle 1 while its peer computes with handle 0 would leave both
        waiting on a gather the other will only issue later.)
        """
        assert self._step_targets is not None, "only inside step()"
        for handle, cache, target in zip(self.handles[:index], self.step_caches,
                                         self._step_targets, strict=False):
            if handle is None or target is None:
                continue
            if self._deciding and cache is not None:
                cache.complete(self.forwards_per_step)
            else:
                handle.idle_until(target)

    def idle_step(self, active: Sequence[bool] | None = None) -> None:
        """A step's gathers of the ``active`` transformers (None: all), computing nothing;
        each forward's first block only, where the group agreed to skip the rest."""
        deciding = bool(getattr(active, "step_cache", False))
        counts = self._counts()
        try:
            for handle, cache, on in zip(self.handles, self.step_caches, self._active(active),
                                         strict=True):
                if handle is None or not on:
                    continue
                if cache is None:
                    for _ in range(self.forwards_per_step):
                        handle.idle_forward()
                    continue
                cache.begin_step(deciding)
                try:
                    cache.complete(self.forwards_per_step)
                finally:
                    cache.end_step()
        except ForwardLeft:
            pass  # the group left the step here: no rank gathers the rest of it
        finally:
            self._count_step(counts)

    def keep_left_blocks(self, on: bool) -> None:
        """Until called with False, a step this rank's job leaves part-way (`StepLeft`) keeps
        the outputs of the blocks it computed, and the same step taken again gives them back
        rather than computing them (`runtime.step_replay`): a preemption loses at most the block
        it came inside. Only for jobs that do not cache steps."""
        if on and self._replay is None:
            # Set up at first use, around whatever else wraps the blocks (the step caches).
            self._replay = StepReplay(h.block_modules for h in self.handles if h is not None)
        self._keeps_left = on

    @property
    def blocks_replayed(self) -> int:
        """Block calls that gave back a left step's kept output instead of computing."""
        return 0 if self._replay is None else self._replay.replayed

    def leave_steps_when(self, check: Callable[[], bool] | None, *,
                         within_blocks: bool = False, late: bool = False) -> None:
        """Until called again with None, the group may leave a step between two blocks of a
        streamed transformer, whenever ``check`` is true on some rank (`DLOHandle.leave_when`):
        every rank then leaves it at the same block, `step` raises `ForwardLeft` with the job's
        state as before the step (its latents and step cache), and `idle_step` returns. Every
        rank of the group calls it for the same steps. ``within_blocks``: a computing rank may
        leave in the middle of a block; ``late``: this rank's check is the one that changes, and
        is looked at until late in each block (`DLOHandle.leave_when`). A job's step left so
        keeps the blocks it computed (`keep_left_blocks`)."""
        self.keep_left_blocks(check is not None)
        for handle in self.handles:
            if handle is not None and handle.gathers:
                handle.leave_when(check, within_blocks=within_blocks, late=late)

    def generate(self, request: VideoRequest,
                 on_step: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """prepare, every step, decode: a rank alone, or every rank running its job in step."""
        state = self.prepare(request)
        while not state.done:
            self.step(state)
            if on_step is not None:
                on_step(state.step_index, state.num_inference_steps)
        return self.decode(state)

    def close(self) -> None:
        for handle in self.handles:
            if handle is not None:
                handle.close()


STEP_CACHE = "step_cache"  # where a caching job keeps its `JobCache`, in ``state.extra``


def job_cache_of(state: DenoiseState) -> JobCache | None:
    """The job's step cache (``runtime.step_cache``), made at its first step from its
    request's ``step_cache``; None for an exact job. Part of its checkpoints
    (`VideoPipeline.resume_tensors`): a resumed job decides as it would have."""
    if state.request.step_cache is None:
        return None
    if STEP_CACHE not in state.extra:
        state.extra[STEP_CACHE] = job_cache(state.request.step_cache)
    return state.extra[STEP_CACHE]


class Agreed(list[bool]):
    """`agree_handles`' answer: per streamed transformer, whether the group runs it this step;
    and ``step_cache``, whether some rank's job caches steps this step."""

    step_cache: bool = False


def agree_handles(pipe: VideoPipeline, state: DenoiseState | None,
                  group: Any = None) -> Agreed:
    """The transformers the group runs this step: the union over its ranks of
    ``pipe.handles_needed`` (a rank without a job, or whose job is done, needs none); and
    whether any rank's job caches steps (then every forward of the step decides on its rest).

    Every rank of ``group`` calls it before every step, in step: it all-reduces (MAX) one small
    int tensor. ``group``: None is the default process group when torch.distributed is
    initialised, else this rank alone (its own needs)."""
    live = state is not None and not state.done
    needs = ([bool(n) for n in pipe.handles_needed(state)] if live and state is not None
             else [False] * len(pipe.handles))
    needs.append(live and state is not None and job_cache_of(state) is not None)
    if (group is not None or (dist.is_available() and dist.is_initialized())) and \
            dist.get_world_size(group) > 1:
        # gloo reduces host tensors; the accelerator backends reduce device ones.
        device = (torch.device("cpu") if str(dist.get_backend(group)) == "gloo"
                  else getattr(pipe, "device", None) or default_device())
        flags = torch.tensor([int(n) for n in needs], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        needs = [bool(v) for v in flags.tolist()]
    agreed = Agreed(needs[:-1])
    agreed.step_cache = needs[-1]
    return agreed

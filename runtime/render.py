"""Render videos without the service: one process (on the default device), or ``dp`` CPU ranks
over gloo sharing weights, started by `runtime.launch`.

With ``dp > 1`` every rank loads the model with DLO (all-gather mode shards the block weights
across the ranks), takes the request with its rank's index if there is one, and all ranks step in
lock-step (``runtime.pipelines.base``): before each step the ranks agree which transformers it
gathers (``agree_handles``), and a rank without a request, or whose request has finished, calls
``idle_step`` until the longest request is done. Each rank with a request writes its own
MP4 (with the soundtrack, where the pipeline makes one) and thumbnail. Rank 0's progress and
every rank's memory figures come back to the parent over a queue.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from common.families import MODEL_INDEX_FILES, TINY, TINY_MODEL, family_of, model_index_path
from runtime.budget import AUTO, DeviceBudget
from runtime.launch import RankContext, run_ranks
from runtime.models.tiny import TRAINED_WEIGHTS
from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest, agree_handles
from runtime.pipelines.tiny import TinyPipeline
from runtime.sequence import SOLO, Layout, SequenceParallel, open_sequence
from runtime.tiling import map_tiles, plan_tiles
from storage.video import Soundtrack, float_to_uint8, write_outputs


@dataclass(kw_only=True, slots=True)
class RankReport:
    rank: int
    out: str | None  # the MP4 this rank wrote (None: it had no request)
    thumbnail: str | None
    num_frames: int
    seconds: float  # load + render + write, this rank
    peak_rss_bytes: int  # VmHWM: the most resident memory this rank held at once
    pss_bytes: int  # proportional set size at the end: shared pages split among their users
    private_bytes: int  # pages only this rank maps
    dlo: dict[str, Any] = field(default_factory=dict)


def load_pipeline(model: str, *, group: Any = None, device: Any = None,
                  use_allgather: bool = True, sequence: SequenceParallel | None = None,
                  device_budget: DeviceBudget = AUTO,
                  max_tokens: int | None = None,
                  weights_dtype: str = "checkpoint") -> VideoPipeline:
    """``kiln-tiny`` or a local diffusers-format model directory, transformer under DLO, in the
    pipeline of its family (``common.families``); ``sequence``: this rank's replica split
    (``runtime.sequence.open_sequence``); ``device_budget``: device memory for resident blocks
    (``runtime.budget``), with activations reserved for the largest job the deployment admits
    (``max_tokens``; default: the family's most); ``weights_dtype``: the dtype the streamed
    blocks are kept and moved in (``runtime.budget.WEIGHTS_DTYPES``, ``apply_dlo``)."""
    if family_of(model) is TINY:
        return TinyPipeline.load(group=group, device=device, use_allgather=use_allgather,
                                 sequence=sequence, device_budget=device_budget,
                                 max_tokens=max_tokens or TINY.max_tokens,
                                 weights_dtype=weights_dtype)
    path = Path(model)
    if model_index_path(model) is None:
        raise ValueError(f"--model must be {TINY_MODEL!r} or a diffusers model directory (with a "
                         f"{' or '.join(MODEL_INDEX_FILES)}); {model!r} is neither")
    # Here, not at the top: a kiln-tiny process never loads diffusers and transformers.
    from runtime.pipelines.registry import load_diffusers

    # The loop its family names, or a ValueError saying which pipelines kiln drives.
    return load_diffusers(path, group=group, device=device, use_allgather=use_allgather,
                          sequence=sequence, device_budget=device_budget, max_tokens=max_tokens,
                          weights_dtype=weights_dtype)


def weight_bytes(model: str) -> int:
    """Bytes of every safetensors file of a model (a diffusers directory's components, or
    kiln-tiny's weights): what one private copy of it holds."""
    if family_of(model) is TINY:
        return TRAINED_WEIGHTS.stat().st_size
    return sum(f.stat().st_size for f in Path(model).rglob("*.safetensors"))


def output_path(out: str | os.PathLike[str], index: int) -> Path:
    """The first request writes ``out``; request i > 0 writes ``<stem>-<i><suffix>``."""
    out = Path(out)
    return out if index == 0 else out.with_name(f"{out.stem}-{index}{out.suffix}")


def memory_figures() -> tuple[int, int, int]:
    """(peak RSS, PSS, private bytes) of this process. PSS and private (USS) come from psutil,
    which reads the kernel's one-line rollup where it exists; where PSS is unknown (not Linux)
    all three are the resident size."""
    proc = psutil.Process()
    try:
        full = proc.memory_full_info()
    except (psutil.AccessDenied, NotImplementedError):
        rss = proc.memory_info().rss
        return rss, rss, rss
    pss = getattr(full, "pss", None)
    if pss is None:
        return full.rss, full.rss, full.rss
    # ru_maxrss is the kernel's high-water mark of the resident set (VmHWM), in KiB on Linux.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak, pss, full.uss


def frames_to_uint8(frames: Any, *, free_bytes: int | None = None) -> Any:
    """[N, H, W, 3] float frames in [0, 1] -> uint8 (`storage.video.float_to_uint8`) on their
    device, in tiles of frames sized by free memory (clip, scale and round each make a float
    copy of whatever they are given)."""
    n, h, w, c = frames.shape
    plan = plan_tiles(n, 3 * h * w * c * frames.element_size(), free_bytes=free_bytes,
                      device=frames.device)
    out = torch.empty((n, h, w, c), dtype=torch.uint8, device=frames.device)
    return map_tiles(float_to_uint8, frames, out, plan)


def soundtrack(pipe: VideoPipeline, state: DenoiseState) -> Soundtrack | None:
    """The finished job's soundtrack, where the pipeline makes one (a ``decode_audio`` that
    gives samples and their rate: MiniMax-H3 with an audio VAE); None otherwise."""
    decode_audio = getattr(pipe, "decode_audio", None)
    sound = decode_audio(state) if decode_audio is not None else None
    return Soundtrack(*sound) if sound is not None else None


def run_lockstep(pipe: VideoPipeline, rank: int, requests: list[VideoRequest],
                 on_step: Callable[[int, int], None] | None = None) -> Any:
    """Request ``rank`` (if there is one) stepped in lock-step with the other ranks, which run
    the others; idle steps until the longest request is done. Each step gathers only the
    transformers some rank needs for it (`agree_handles`: every rank calls it, in step). Returns
    the decoded float frames, or None on a rank without a request."""
    state = step_lockstep(pipe, rank, requests, on_step)
    return pipe.decode(state) if state is not None else None


def step_lockstep(pipe: VideoPipeline, rank: int, requests: list[VideoRequest],
                  on_step: Callable[[int, int], None] | None = None) -> DenoiseState | None:
    """`run_lockstep`'s steps: the finished state of request ``rank``, not yet decoded (None on
    a rank without a request)."""
    request = requests[rank] if rank < len(requests) else None
    num_inference_steps = max(r.num_inference_steps for r in requests)
    state = pipe.prepare(request) if request is not None else None
    for i in range(num_inference_steps):
        active = agree_handles(pipe, state)
        if state is not None and not state.done:
            pipe.step(state, active)
        else:
            pipe.idle_step(active)
        if on_step is not None:
            on_step(i + 1, num_inference_steps)
    return state


def render_rank(pipe: VideoPipeline, rank: int, requests: list[VideoRequest], out: str,
                on_step: Callable[[int, int], None] | None = None, *,
                started: float | None = None, layout: Layout = SOLO,
                audio: bool = True) -> RankReport:
    """This rank's share of a lock-step render: its replica's request (if any), written at its
    ``fps`` by the replica's first rank; idle steps otherwise. ``audio``: whether the MP4 gets
    the soundtrack, where the pipeline makes one."""
    started = time.perf_counter() if started is None else started
    index = layout.replica(rank)
    state = step_lockstep(pipe, index, requests, on_step)
    decoded = pipe.decode(state) if state is not None else None
    video = thumb = None
    num_frames = 0
    if state is not None and decoded is not None and layout.is_leader(rank):
        frames = frames_to_uint8(decoded).cpu().numpy()
        num_frames = int(frames.shape[0])
        video, thumb = write_outputs(frames, output_path(out, index), fps=requests[index].fps,
                                     audio=soundtrack(pipe, state) if audio else None)
    peak, pss, private = memory_figures()
    dlo = next((h.stats() for h in pipe.handles if h is not None), {})
    return RankReport(rank=rank, out=str(video) if video else None,
                      thumbnail=str(thumb) if thumb else None, num_frames=num_frames,
                      seconds=time.perf_counter() - started, peak_rss_bytes=peak,
                      pss_bytes=pss, private_bytes=private, dlo=dlo)


def _load_on_rank(model: str, use_allgather: bool, layout: Layout,
                  device_budget: DeviceBudget = AUTO,
                  weights_dtype: str = "checkpoint") -> VideoPipeline:
    # gloo ranks; every rank opens the replicas' groups in step, before DLO opens its own.
    return load_pipeline(model, device="cpu", use_allgather=use_allgather,
                         sequence=open_sequence(layout, "gloo"), device_budget=device_budget,
                         weights_dtype=weights_dtype)


def _render_on_rank(ctx: RankContext, model: str, requests: list[VideoRequest], out: str,
                    use_allgather: bool, layout: Layout, device_budget: DeviceBudget,
                    weights_dtype: str = "checkpoint", audio: bool = True) -> RankReport:
    started = time.perf_counter()
    pipe = _load_on_rank(model, use_allgather, layout, device_budget, weights_dtype)
    try:
        step_cb = ((lambda i, n: ctx.messages.put(("step", ctx.rank, i, n)))
                   if ctx.rank == 0 else None)
        return render_rank(pipe, ctx.rank, requests, out, step_cb, started=started,
                           layout=layout, audio=audio)
    finally:
        pipe.close()


def _generate_on_rank(ctx: RankContext, model: str, requests: list[VideoRequest],
                      use_allgather: bool, layout: Layout) -> Any:
    pipe = _load_on_rank(model, use_allgather, layout)
    try:
        frames = run_lockstep(pipe, layout.replica(ctx.rank), requests)
        return frames.cpu().numpy() if frames is not None else None
    finally:
        pipe.close()


def generate_on_ranks(model: str, requests: list[VideoRequest], dp: int, *, sp: int = 1,
                      use_allgather: bool = True, timeout_s: float = 600.0) -> list[Any]:
    """Float frames ([N, H, W, 3] numpy) per rank (every rank of a replica returns its
    replica's), None for ranks without a request; no files. ``dp * sp`` ranks."""
    layout = Layout(dp=dp, sp=sp)
    return run_ranks(layout.world, _generate_on_rank, model, requests, use_allgather, layout,
                     timeout_s=timeout_s)


def _generate_rounds_on_rank(ctx: RankContext, model: str, requests: list[VideoRequest],
                             use_allgather: bool) -> list[Any]:
    pipe = load_pipeline(model, device="cpu", use_allgather=use_allgather)  # gloo ranks
    try:
        frames = []
        for start in range(0, len(requests), ctx.world):
            out = run_lockstep(pipe, ctx.rank, requests[start:start + ctx.world])
            frames.append(out.cpu().numpy() if out is not None else None)
        return frames
    finally:
        pipe.close()


def generate_in_rounds(model: str, requests: list[VideoRequest], dp: int, *,
                       use_allgather: bool = True, timeout_s: float = 600.0) -> list[Any]:
    """Float frames ([N, H, W, 3] numpy) per request, any number of them: ``dp`` at a time in
    lock-step (request i on rank i % dp), every rank loading the model once."""
    per_rank = run_ranks(dp, _generate_rounds_on_rank, model, requests, use_allgather,
                         timeout_s=timeout_s)
    return [per_rank[i % dp][i // dp] for i in range(len(requests))]


def render(model: str, requests: list[VideoRequest], out: str | os.PathLike[str], *,
           dp: int = 1, sp: int = 1, use_allgather: bool = True,
           device_budget: DeviceBudget = AUTO,
           weights_dtype: str = "checkpoint",
           on_step: Callable[[int, int], None] | None = None,
           on_sample: Callable[[int], None] | None = None,
           timeout_s: float = 3600.0, audio: bool = True) -> list[RankReport]:
    """Render ``requests`` (at most ``dp``) on ``dp`` replicas of ``sp`` ranks each (request i
    on replica i, its token sequence split over the replica's ranks); one report per rank;
    ``weights_dtype``: see `load_pipeline`; ``audio``: whether the MP4s get the soundtrack the
    pipeline makes (MiniMax-H3's)."""
    if not requests:
        raise ValueError("no request to render")
    layout = Layout(dp=dp, sp=sp)
    if len(requests) > dp:
        raise ValueError(f"{len(requests)} prompts need dp >= {len(requests)} (one per "
                         f"replica), got dp={dp}")
    out = str(out)
    if layout.world == 1:
        pipe = load_pipeline(model, use_allgather=use_allgather, device_budget=device_budget,
                             weights_dtype=weights_dtype)
        try:
            return [render_rank(pipe, 0, requests, out, on_step, audio=audio)]
        finally:
            pipe.close()

    def on_message(kind: str, rank: int, payload: tuple[Any, ...]) -> None:
        if kind == "step" and on_step is not None:
            on_step(*payload)

    return run_ranks(layout.world, _render_on_rank, model, requests, out, use_allgather, layout,
                     device_budget, weights_dtype, audio, on_message=on_message,
                     on_sample=on_sample,
                     timeout_s=timeout_s)

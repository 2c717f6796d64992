"""``kiln render`` (one video, or one per rank, without the service) and ``kiln make-checkpoint``.

Heavy imports (torch, diffusers) happen inside the commands so ``kiln --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from common import admission
from common.families import checkpoint_family
from common.render import RenderFields
from kiln.cli.options import (
    DeviceBudgetOption,
    WeightsDtypeOption,
    device_budget,
    parse_weights_dtype,
)

app = typer.Typer()


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` -> (width, height)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", size)
    if not m:
        raise typer.BadParameter(f"expected WIDTHxHEIGHT such as 64x64, got {size!r}")
    return int(m.group(1)), int(m.group(2))


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


@app.command()
def render(
    prompt: Annotated[list[str], typer.Option(help="Prompt; repeat it for one video per replica.")],
    out: Annotated[Path, typer.Option(help="Output MP4; prompt i > 0 writes OUT-i.mp4.")],
    model: Annotated[str, typer.Option(help="'kiln-tiny' or a diffusers model directory.")] = (
        "kiln-tiny"),
    size: Annotated[str | None, typer.Option(
        help="WIDTHxHEIGHT in pixels [default: the model family's]")] = None,
    frames: Annotated[int | None, typer.Option(
        help="Number of frames [default: the model family's]")] = None,
    steps: Annotated[int | None, typer.Option(
        help="Denoising steps [default: the model family's]")] = None,
    seed: Annotated[int, typer.Option(help="Noise seed (prompt i uses SEED + i).")] = 0,
    guidance: Annotated[float | None, typer.Option(
        help="Classifier-free guidance scale [default: the model family's]")] = None,
    negative_prompt: Annotated[str, typer.Option(help="Negative prompt.")] = "",
    fps: Annotated[int | None, typer.Option(
        help="Frames per second of the MP4 [default: the model family's]")] = None,
    dp: Annotated[int, typer.Option(
        help="Replicas, each rendering its own prompt; all ranks share one copy of the "
             "weights over gloo.")] = 1,
    sp: Annotated[int, typer.Option(
        help="Ranks per replica: each prompt's token sequence is split over them "
             "(sequence parallelism); dp x sp CPU ranks in all.")] = 1,
    rank_local: Annotated[bool, typer.Option(
        help="Each rank reads whole blocks instead of sharding them; on the CPU they stay "
             "bound to the checkpoint's mapping, one copy that all ranks share.")] = False,
    budget: DeviceBudgetOption = "auto",
    weights_dtype: WeightsDtypeOption = "checkpoint",
    image: Annotated[Path | None, typer.Option(
        help="An image to start from (PNG, JPEG, WebP), for a model that takes one.")] = None,
    video: Annotated[Path | None, typer.Option(
        help="A video to start from (MP4, WebM), for a model that takes one.")] = None,
    fit: Annotated[str, typer.Option(
        help="How --image/--video is fitted to the size: crop, pad or stretch.")] = "crop",
    strength: Annotated[float | None, typer.Option(
        help="Video-to-video: how far the render moves from --video (1: pure noise).")] = None,
    audio: Annotated[bool, typer.Option(
        help="Write the soundtrack the model makes (MiniMax-H3) into the MP4.")] = True,
) -> None:
    """Render videos with DLO, without the service, and write MP4 + PNG thumbnail. A request
    the model cannot render is refused before anything loads."""
    # Here, not at the top: torch and the model code load only for the commands that render.
    from runtime.launch import RankFailure
    from runtime.pipelines.base import VideoRequest
    from runtime.render import output_path, weight_bytes
    from runtime.render import render as run_render

    console = Console(stderr=True)
    # What the request leaves out is the model family's own default (read from the model's
    # configs, no weights loaded): MiniMax-H3 renders 124 frames, kiln-tiny 9.
    family = checkpoint_family(model)
    d = family.defaults
    width, height = parse_size(size) if size is not None else (d.width, d.height)
    fields = RenderFields(prompt=prompt[0], negative_prompt=negative_prompt, width=width,
                          height=height, seed=seed,
                          num_frames=d.num_frames if frames is None else frames,
                          num_inference_steps=d.num_inference_steps if steps is None else steps,
                          guidance_scale=d.guidance_scale if guidance is None else guidance,
                          fps=d.fps if fps is None else fps)
    if image is not None and video is not None:
        raise typer.BadParameter("give --image or --video, not both")
    source = image or video
    kind = None if source is None else ("image" if image is not None else "video")
    problems = (admission.model_problems(family, fields)
                + admission.input_problems(family, kind, field="--image/--video", fit=fit,
                                           strength=strength))
    if problems:
        for problem in problems:
            console.print(f"[red]error:[/red] {problem}")
        raise typer.Exit(2)
    conditioning = None if source is None else _conditioning(source, kind, fields, fit, strength)
    try:
        requests = [VideoRequest.of(dataclasses.replace(fields, prompt=p, seed=seed + i),
                                    conditioning=conditioning)
                    for i, p in enumerate(prompt)]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    steps = fields.num_inference_steps
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task(f"loading {model} on {dp * sp} rank(s)", total=steps)

        def on_step(i: int, n: int) -> None:
            progress.update(task, completed=i, total=n, description="denoising")

        pss_samples: list[int] = []
        try:
            reports = run_render(model, requests, out, dp=dp, sp=sp,
                                 use_allgather=not rank_local,
                                 device_budget=device_budget(budget),
                                 weights_dtype=parse_weights_dtype(weights_dtype),
                                 on_step=on_step, on_sample=pss_samples.append, audio=audio)
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from exc
        except RankFailure as exc:
            console.print(f"[red]render failed:[/red] {exc}")
            raise typer.Exit(1) from exc
        progress.update(task, description="done")
    for r in reports:
        if r.out is not None:
            typer.echo(f"{r.out} ({r.num_frames} frames, thumbnail {r.thumbnail}, rank {r.rank}, "
                       f"{r.seconds:.1f} s, peak RSS {_size(r.peak_rss_bytes)})")
    if pss_samples:
        # PSS splits shared pages (the mapped checkpoint, libraries) among the ranks mapping
        # them, so the sum counts every page once: the host memory the ranks hold together.
        ranks = dp * sp
        weights = weight_bytes(model)
        typer.echo(f"host memory, {ranks} ranks together (summed PSS): peak "
                   f"{_size(max(pss_samples))}; per rank peak RSS: "
                   + ", ".join(_size(r.peak_rss_bytes) for r in reports)
                   + "; per rank blocks: " + ", ".join(_blocks_held(r.dlo) for r in reports))
        typer.echo(f"model weights {_size(weights)}: {ranks} private copies would hold "
                   f"{_size(ranks * weights)} before any rank's own memory")
        dlo = reports[0].dlo
        if dlo.get("weights_dtype", "checkpoint") != "checkpoint":
            typer.echo(f"blocks kept and moved in {dlo['weights_dtype']}: "
                       f"{_size(dlo['stored_block_bytes'])} (as the checkpoint stores them: "
                       f"{_size(dlo['block_bytes'])})")
    missing = [str(output_path(out, i)) for i in range(len(requests))
               if not any(r.out == str(output_path(out, i)) for r in reports)]
    if missing:
        console.print(f"[red]error:[/red] no output for {missing}")
        raise typer.Exit(1)


def _conditioning(path: Path, kind: str | None, r: RenderFields, fit: str,
                  strength: float | None):  # noqa: ANN202 - a runtime Conditioning
    """The input at ``path``, checked as an upload is (`storage.media`) and fitted to the
    request's size; a bad file is refused naming the problem."""
    # Here, not at the top: torch, the media decoders and the runtime load only for a render
    # that starts from a file.
    import numpy as np
    import torch

    from common.settings import Settings
    from runtime.pipelines.base import Conditioning
    from storage import media

    limits = media.Limits.of(Settings())
    try:
        with open(path, "rb") as file:
            found = media.check(file, limits, filename=path.name)
            if found.kind != kind:
                raise typer.BadParameter(f"{path} is a {found.kind}, not a {kind}")
            frames = media.fitted_frames(file, found.kind, limits, r.width, r.height,
                                         cast("media.FitMode", fit),  # input_problems checked it
                                         max_frames=r.num_frames)
    except OSError as exc:
        raise typer.BadParameter(f"{path}: {exc.strerror or exc}") from exc
    except media.Rejected as exc:
        raise typer.BadParameter(f"{path}: {exc}") from exc
    pixels = torch.from_numpy(np.stack([np.asarray(frame) for frame in frames]))
    if kind == "image":
        return Conditioning(image=pixels[0])
    return Conditioning(video=pixels, strength=strength)


def _blocks_held(dlo: dict) -> str:
    """Where a rank's transformer blocks live, from its DLO handle's stats."""
    if dlo.get("mapped_blocks"):
        return "bound to the shared checkpoint mapping"
    stored = dlo.get("weights_dtype", "checkpoint")
    return (f"host shard {_size(dlo.get('host_shard_bytes', 0))}"
            + ("" if stored == "checkpoint" else f" in {stored}"))


@app.command("make-checkpoint")
def make_checkpoint(
    out: Annotated[Path, typer.Option(help="Directory to write (diffusers format).")],
    family: Annotated[str, typer.Option(
        help="Model family: wan, wan-i2v, wan22-i2v, cogvideox, cosmos3 or minimax-h3.")] = "wan",
    layers: Annotated[int, typer.Option(help="Transformer blocks.")] = 2,
    width: Annotated[int, typer.Option(help="Transformer hidden size.")] = 64,
    head_dim: Annotated[int, typer.Option(help="Attention head size.")] = 128,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write a random-weight diffusers model directory of any size (for benchmarks)."""
    # Here, not at the top: torch and diffusers load only for the commands that need them.
    import torch

    from runtime.models.synthetic import SyntheticSpec, checkpoint_bytes
    from runtime.models.synthetic import make_checkpoint as write_checkpoint

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise typer.BadParameter(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    try:
        spec = SyntheticSpec(family=family, num_layers=layers, width=width, head_dim=head_dim,
                             dtype=dtypes[dtype], seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    path = write_checkpoint(out, spec)
    typer.echo(f"{path}: {family}, {layers} layers, width {width}, transformer "
               f"{checkpoint_bytes(path) / 1e9:.2f} GB")

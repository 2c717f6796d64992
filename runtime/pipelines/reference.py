"""diffusers' own pipelines, called as their documentation calls them: what kiln's loops are
checked against (bit for bit, in the tests) and what the benchmarks measure kiln beside (each
rank a whole private copy of the model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import PIL.Image
import torch

from common.families import COSMOS3, MINIMAX_H3, WAN_I2V, family_of, model_index
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.minimax_h3 import t2v_blocks


def open_reference(model_dir: str | Path) -> Any:
    """The model directory's diffusers pipeline, every component loaded whole (no DLO)."""
    model_dir = Path(model_dir)
    if family_of(str(model_dir)) is MINIMAX_H3:
        pipe = t2v_blocks().init_pipeline(str(model_dir))
        pipe.load_components(local_files_only=True)
        return pipe
    name = model_index(str(model_dir))["_class_name"]
    extra = {"enable_safety_checker": False} if family_of(str(model_dir)) is COSMOS3 else {}
    pipe = getattr(diffusers, name).from_pretrained(model_dir, local_files_only=True, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pil(pixels: torch.Tensor | None) -> PIL.Image.Image | None:
    return None if pixels is None else PIL.Image.fromarray(pixels.cpu().numpy())


def run_reference(pipe: Any, family: str, request: VideoRequest) -> np.ndarray:
    """``request`` through diffusers' pipeline of ``family`` (a `common.families` name): float
    frames [N, H, W, 3] in [0, 1]. Its conditioning goes in as the PIL images diffusers'
    examples pass, at the request's size (Cosmos3: ``image`` or ``video``); a Wan clip goes
    through ``WanVideoToVideoPipeline`` around ``pipe``'s components, as its docs load it from
    a text-to-video directory."""
    generator = torch.Generator().manual_seed(request.seed)
    size = {"height": request.height, "width": request.width, "num_frames": request.num_frames,
            "num_inference_steps": request.num_inference_steps}
    if family == MINIMAX_H3.name:  # guidance-distilled: no negative prompt, no scale
        return pipe(prompt=request.prompt, generator=generator, output_type="np",
                    **size).get("videos")[0]
    guidance = {"negative_prompt": request.negative_prompt,
                "guidance_scale": request.guidance_scale}
    c = request.conditioning
    inputs: dict[str, Any] = {}
    if family == COSMOS3.name:  # a first frame, or a clip whose first frames it keeps
        if c is not None:
            inputs = {"image": _pil(c.image),
                      "video": None if c.video is None else [_pil(f) for f in c.video]}
        return pipe(prompt=request.prompt, fps=float(request.fps), generator=generator,
                    output_type="np", **guidance, **inputs, **size).video
    if family == WAN_I2V.name and c is not None:
        inputs = {"image": _pil(c.image), "last_image": _pil(c.last_image)}
    elif c is not None and c.video is not None:
        pipe = diffusers.WanVideoToVideoPipeline(**{
            n: pipe.components[n]
            for n in ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")})
        pipe.set_progress_bar_config(disable=True)
        del size["num_frames"]  # the clip's
        inputs = {"video": [_pil(f) for f in c.video]}
        if c.strength is not None:
            inputs["strength"] = c.strength
    return pipe(prompt=request.prompt, generator=generator, output_type="np", **guidance,
                **inputs, **size).frames[0]

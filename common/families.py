"""The model families kiln renders, each described once: how it loads, what a request gets for
the fields it leaves out, and the geometry of its latents.

A model renders best at the size, length and step count it was trained for: kiln-tiny at 64x64
and 9 frames, Wan at 832x480 and 81 frames. The API fills a job's missing fields from its
family's ``defaults`` (a ``KILN_DEFAULT_*`` setting, when set, wins for every model); the
runtime loads the pipeline the family names and refuses sizes and lengths the family cannot
render; the batcher counts a job's video tokens with the family's VAE and patch. Reading this
needs no torch and no weights: kiln-tiny is known by name, a diffusers directory by the pipeline
class its ``model_index.json`` names (`family_of`).

The numbers are those of the released checkpoints, read from their diffusers configs and
pipelines (diffusers 0.42). Where one checkpoint differs (Wan2.2 TI2V-5B's VAE compresses 16x in
space, CogVideoX 1.5 patches time by 2), the runtime reads the loaded model's own config, and
the family's numbers stay the floor (sizes) and the estimate (tokens).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from common.render import RequestDefaults

TINY_MODEL = "kiln-tiny"


@dataclass(kw_only=True, frozen=True, slots=True)
class Family:
    """One model family: the pipeline that renders it, its request defaults, what sizes and
    lengths it renders, and the geometry of its latents (which the batcher's cost counts)."""

    name: str
    # The ``_class_name``s of the diffusers pipelines (in ``model_index.json``) of this family.
    diffusers_classes: tuple[str, ...] = ()
    # The runtime's pipeline class that renders this family, by name (``runtime.render`` maps it
    # to the class); None: kiln cannot render it.
    pipeline: str | None
    defaults: RequestDefaults  # what a request gets for the fields it leaves out
    size_multiple: int  # width and height are multiples of this
    frame_stride: int  # the family renders 1 + k * frame_stride frames
    patch_size: tuple[int, int, int]  # the transformer's patch: (frames, height, width)
    vae_scale_factor_spatial: int  # pixels per latent pixel, along height and width
    vae_scale_factor_temporal: int  # frames per latent frame, after the first (a causal VAE)


# kiln-tiny (``runtime.models.tiny.TinyConfig``): spatial_compression 8 times patch_size 2, and
# temporal_compression 4. Its defaults are what it was trained on (scripts/train_tiny.py) and
# what `kiln render` uses.
TINY = Family(
    name=TINY_MODEL, pipeline="TinyPipeline",
    defaults=RequestDefaults(width=64, height=64, num_frames=9, fps=8, num_inference_steps=4,
                             guidance_scale=5.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
)
# Wan2.1 and Wan2.2 T2V: ``WanPipeline.__call__``'s defaults (832x480, 81 frames, 50 steps,
# guidance 5) at the 16 fps of its examples; ``check_inputs`` wants sizes divisible by 16;
# ``AutoencoderKLWan``: scale_factor_spatial 8, scale_factor_temporal 4;
# ``WanTransformer3DModel``: patch_size (1, 2, 2).
WAN = Family(
    name="wan", diffusers_classes=("WanPipeline",), pipeline="WanVideoPipeline",
    defaults=RequestDefaults(width=832, height=480, num_frames=81, fps=16,
                             num_inference_steps=50, guidance_scale=5.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
)
# CogVideoX: ``CogVideoXPipeline.__call__``'s defaults (the transformer's sample size 90x60
# latents times the VAE's 8: 720x480; 49 frames, 50 steps, guidance 6) at the 8 fps of its
# examples; ``AutoencoderKLCogVideoX``: 4 blocks (2**3 = 8 in space), temporal_compression_ratio
# 4; ``CogVideoXTransformer3DModel``: patch_size 2, no time patch (1.0).
COGVIDEOX = Family(
    name="cogvideox", diffusers_classes=("CogVideoXPipeline",),
    pipeline="CogVideoXVideoPipeline",
    defaults=RequestDefaults(width=720, height=480, num_frames=49, fps=8,
                             num_inference_steps=50, guidance_scale=6.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
)
# Anything else: no pipeline; defaults small enough to finish on a CPU, large enough to see; the
# geometry of a typical video DiT (a causal VAE of 4x8x8, patch 1x2x2) for its cost.
GENERIC = Family(
    name="generic", pipeline=None,
    defaults=RequestDefaults(width=256, height=256, num_frames=17, fps=8,
                             num_inference_steps=30, guidance_scale=5.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
)

FAMILIES = (TINY, WAN, COGVIDEOX)
_BY_DIFFUSERS_CLASS = {c: f for f in FAMILIES for c in f.diffusers_classes}


@functools.cache
def family_of(model: str) -> Family:
    """The family of ``model``: kiln-tiny by name, a diffusers model directory by the pipeline
    class its ``model_index.json`` names; `GENERIC` for anything else."""
    if model == TINY_MODEL:
        return TINY
    try:
        index = json.loads((Path(model) / "model_index.json").read_text())
    except (OSError, ValueError):
        return GENERIC
    name = index.get("_class_name") if isinstance(index, dict) else None
    return _BY_DIFFUSERS_CLASS.get(name, GENERIC) if isinstance(name, str) else GENERIC

"""What a request gets for the fields it leaves out, per model.

A model renders best at the size, length and step count it was trained for: kiln-tiny at 64x64
and 9 frames, Wan at 832x480 and 81 frames. The API fills a job's missing fields from here
(a ``KILN_DEFAULT_*`` setting, when set, wins for every model). Reading this needs no torch and no
weights: kiln-tiny is known by name, a diffusers directory by the pipeline class its
``model_index.json`` names.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

TINY_MODEL = "kiln-tiny"


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    width: int
    height: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    fps: int


# kiln-tiny: what it was trained on (scripts/train_tiny.py) and what `kiln render` uses.
TINY = RequestDefaults(width=64, height=64, num_frames=9, num_inference_steps=4,
                       guidance_scale=5.0, fps=8)
# The defaults of the diffusers pipelines these models ship with.
BY_PIPELINE_CLASS = {
    "WanPipeline": RequestDefaults(width=832, height=480, num_frames=81, num_inference_steps=50,
                                   guidance_scale=5.0, fps=16),
    "CogVideoXPipeline": RequestDefaults(width=720, height=480, num_frames=49,
                                         num_inference_steps=50, guidance_scale=6.0, fps=8),
}
# Anything else: small enough to finish on a CPU, large enough to see.
GENERIC = RequestDefaults(width=256, height=256, num_frames=17, num_inference_steps=30,
                          guidance_scale=5.0, fps=8)


@functools.cache
def request_defaults(model: str) -> RequestDefaults:
    """The defaults for ``model``: kiln-tiny, a diffusers model directory, or `GENERIC`."""
    if model == TINY_MODEL:
        return TINY
    try:
        index = json.loads((Path(model) / "model_index.json").read_text())
    except (OSError, ValueError):
        return GENERIC
    name = index.get("_class_name") if isinstance(index, dict) else None
    return BY_PIPELINE_CLASS.get(name, GENERIC) if isinstance(name, str) else GENERIC

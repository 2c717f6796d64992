"""The loop that renders each diffusers family, by the name its ``common.families.Family``
gives in ``pipeline``; and loading a model directory into it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.families import FAMILIES, family_of, model_index
from runtime.pipelines.cosmos3 import Cosmos3VideoPipeline
from runtime.pipelines.diffusers_video import (
    CogVideoXVideoPipeline,
    DiffusersVideoPipeline,
    WanVideoPipeline,
)
from runtime.pipelines.minimax_h3 import MiniMaxH3VideoPipeline
from runtime.pipelines.wan_i2v import WanI2VPipeline

PIPELINES: dict[str, type[DiffusersVideoPipeline]] = {
    c.__name__: c for c in (WanVideoPipeline, WanI2VPipeline, CogVideoXVideoPipeline,
                            Cosmos3VideoPipeline, MiniMaxH3VideoPipeline)}
assert all(c.family.pipeline == name for name, c in PIPELINES.items())


def load_diffusers(model_dir: str | Path, **kwargs: Any) -> DiffusersVideoPipeline:
    """The loop of ``model_dir``'s family around its components, transformer(s) under DLO
    (``DiffusersVideoPipeline.load`` takes ``kwargs``); a ValueError naming the pipelines kiln
    drives when the directory's is not one of them."""
    loop = PIPELINES.get(family_of(str(model_dir)).pipeline or "")
    if loop is None:
        supported = sorted(c for f in FAMILIES if f.pipeline in PIPELINES
                           for c in f.diffusers_classes)
        name = model_index(str(model_dir)).get("_class_name", "")
        raise ValueError(f"{model_dir}: pipeline {name!r} is not supported; kiln drives "
                         f"{', '.join(supported)}")
    return loop.load(model_dir, **kwargs)


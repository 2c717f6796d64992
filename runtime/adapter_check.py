"""Checking a LoRA file against a model's transformers without loading the model's weights.

The API checks every adapter when it is registered (``POST /v1/adapters``): the same
`runtime.adapters.load_adapter` a rank runs, against the model's transformers built on the meta
device, where their Linears have names and shapes but no memory. kiln-tiny is built from its
config; a diffusers directory's transformers (``transformer``, ``transformer_2``,
``transformer_ref``) from their ``config.json`` (`runtime.models.loading.build_on_meta`). Each
model's meta transformers are built once per process.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.families import TINY_MODEL, checkpoint_family
from runtime.adapters import LOADERS, TRANSFORMER_NAMES, Adapter, load_adapter
from runtime.models.tiny import TinyConfig, TinyTransformer


@dataclass(frozen=True, slots=True)
class Checked:
    """A file that fits the model: its family, its largest rank, the sha256 of its bytes."""

    adapter: Adapter
    family: str
    rank: int
    sha256: str
    size_bytes: int


def check_adapter_file(path: str | Path, model: str) -> Checked:
    """``path`` checked against ``model``'s transformers; a ``ValueError`` names the first
    problem (not safetensors, a family that takes no adapters, an unknown key, a shape or rank
    that does not fit)."""
    path = Path(path)
    family = checkpoint_family(model).name
    if family not in LOADERS:  # before building anything of a model kiln cannot adapt
        raise ValueError(f"{model} is a {family} model; {family} takes no LoRA adapters "
                         f"({', '.join(LOADERS)} do)")
    adapter = load_adapter(path, family, meta_transformers(model), name=path.stem)
    data = path.read_bytes()
    return Checked(adapter=adapter, family=family,
                   rank=max(layer.rank for layer in adapter.layers.values()),
                   sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


@functools.lru_cache(maxsize=8)
def meta_transformers(model: str) -> dict[str, nn.Module]:
    """``model``'s transformers by their pipeline attribute, parameters on the meta device."""
    if model == TINY_MODEL:
        with torch.device("meta"):
            return {"transformer": TinyTransformer(TinyConfig())}
    from runtime.models.loading import build_on_meta  # diffusers: only for such a model

    found = {name: build_on_meta(Path(model) / name) for name in TRANSFORMER_NAMES
             if (Path(model) / name / "config.json").is_file()}
    if not found:
        raise ValueError(f"{model}: no transformer to adapt")
    return found

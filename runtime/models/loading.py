"""Build a diffusers model on the meta device, ready for ``apply_dlo(checkpoint=...)``.

Parameters go to the meta device as they are registered (no memory, no initialisation), while
buffers are created for real: non-persistent buffers such as rotary tables are not in checkpoints
and must hold their computed values, and they are small. Each tensor then takes the dtype the
checkpoint stores it in, so the engine streams the stored bytes without conversion (a model whose
norms are kept in fp32 next to bf16 weights loads as stored).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from torch import nn

from runtime.dlo.checkpoint import Checkpoint


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, their buffers for real."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]  # undone below
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]  # restored


def model_class(model_dir: Path) -> type:
    """The class ``config.json`` names: a diffusers model's ``_class_name``, or a transformers
    model's first ``architectures`` entry (the text encoders of the video pipelines)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    config = json.loads(config_path.read_text())
    if "_class_name" not in config and config.get("architectures"):
        name = config["architectures"][0]
        cls = getattr(transformers, name, None)
    else:
        name = config.get("_class_name")
        cls = getattr(diffusers, name or "", None)
    if cls is None:
        raise ValueError(f"{config_path}: unknown model class {name!r}")
    return cls


def match_checkpoint_dtypes(model: nn.Module, ckpt: Checkpoint) -> None:
    """Give every meta tensor of ``model`` the dtype its checkpoint entry has."""
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in ckpt or not t.is_meta or ckpt.info(name).dtype == t.dtype:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        new = torch.empty(t.shape, dtype=ckpt.info(name).dtype, device="meta")
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(new, requires_grad=False)
        else:
            owner._buffers[attr] = new


def build_on_meta(model_dir: str | os.PathLike[str]) -> Any:
    """A diffusers (or transformers) model from ``model_dir``'s config: parameters on meta,
    checkpoint dtypes."""
    model_dir = Path(model_dir)
    cls: Any = model_class(model_dir)  # a diffusers or transformers model, by its name
    with meta_parameters():
        if hasattr(cls, "from_config"):
            model = cls.from_config(cls.load_config(model_dir))
        else:
            model = cls(cls.config_class.from_pretrained(model_dir))
    ckpt = Checkpoint.open(model_dir)
    try:
        match_checkpoint_dtypes(model, ckpt)
    finally:
        ckpt.close()
    return model.eval().requires_grad_(False)

"""The model-family registry: found by what names a model, and true to the configs it describes."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from common.families import COGVIDEOX, GENERIC, TINY, WAN, family_of
from runtime.models.tiny import TinyConfig
from scheduler.cost import tokens


def _model_dir(path: Path, class_name: str) -> str:
    path.mkdir()
    (path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return str(path)


def test_kiln_tiny_is_known_by_name_and_a_directory_by_its_pipeline_class(tmp_path: Path) -> None:
    assert family_of("kiln-tiny") is TINY
    assert family_of(_model_dir(tmp_path / "wan", "WanPipeline")) is WAN
    assert family_of(_model_dir(tmp_path / "cog", "CogVideoXPipeline")) is COGVIDEOX
    assert family_of(_model_dir(tmp_path / "other", "LTXPipeline")) is GENERIC
    assert family_of(str(tmp_path / "missing")) is GENERIC


def test_the_kiln_tiny_family_matches_its_config() -> None:
    cfg = TinyConfig()
    assert TINY.size_multiple == cfg.spatial_compression * cfg.patch_size
    assert TINY.frame_stride == TINY.vae_scale_factor_temporal == cfg.temporal_compression
    assert TINY.vae_scale_factor_spatial == cfg.spatial_compression
    assert TINY.patch_size == (1, cfg.patch_size, cfg.patch_size)


def _default(fn: Any, name: str) -> Any:
    return inspect.signature(fn).parameters[name].default


def test_the_diffusers_families_match_the_diffusers_defaults() -> None:
    diffusers = pytest.importorskip("diffusers")
    call = diffusers.WanPipeline.__call__
    d = WAN.defaults
    assert (d.width, d.height, d.num_frames, d.num_inference_steps, d.guidance_scale) == tuple(
        _default(call, n) for n in ("width", "height", "num_frames", "num_inference_steps",
                                    "guidance_scale"))
    vae = diffusers.AutoencoderKLWan.__init__
    assert WAN.vae_scale_factor_spatial == _default(vae, "scale_factor_spatial")
    assert WAN.vae_scale_factor_temporal == WAN.frame_stride == _default(
        vae, "scale_factor_temporal")
    assert WAN.patch_size == _default(diffusers.WanTransformer3DModel.__init__, "patch_size")

    call = diffusers.CogVideoXPipeline.__call__
    transformer = diffusers.CogVideoXTransformer3DModel.__init__
    vae = diffusers.AutoencoderKLCogVideoX.__init__
    spatial = 2 ** (len(_default(vae, "block_out_channels")) - 1)
    d = COGVIDEOX.defaults
    assert (d.num_inference_steps, d.guidance_scale) == (
        _default(call, "num_inference_steps"), _default(call, "guidance_scale"))
    assert (d.width, d.height, d.num_frames) == (
        _default(transformer, "sample_width") * spatial,
        _default(transformer, "sample_height") * spatial,
        _default(transformer, "sample_frames"))
    assert COGVIDEOX.vae_scale_factor_spatial == spatial
    assert COGVIDEOX.vae_scale_factor_temporal == COGVIDEOX.frame_stride == _default(
        vae, "temporal_compression_ratio")
    patch = _default(transformer, "patch_size")
    assert COGVIDEOX.patch_size == (1, patch, patch)
    assert COGVIDEOX.size_multiple == spatial * patch


def test_tokens_count_the_family_latents_in_patches() -> None:
    assert tokens(64, 64, 9, family=TINY) == 3 * 4 * 4
    # Wan at its defaults: 21 latent frames of 60x104, patches of 1x2x2.
    assert tokens(832, 480, 81, family=WAN) == 21 * 30 * 52

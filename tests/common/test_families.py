"""The model-family registry: found by what names a model, and true to the configs it describes."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from common import families
from common.families import (
    COGVIDEOX,
    COSMOS3,
    GENERIC,
    MINIMAX_H3,
    TINY,
    WAN,
    checkpoint_family,
    family_of,
    latent_shape,
)
from runtime.models.tiny import TinyConfig
from scheduler import cost
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


def test_tokens_count_the_prompt_and_soundtrack_rows_the_sequence_holds() -> None:
    # MiniMax-H3: 5n + 2 latent frames of 17n + 5, 1x2x2 patches of 16x latents; 2 channels of
    # round(frames / 24 x 40) audio latents; the prompt's rows.
    assert latent_shape(1344, 768, 124, family=MINIMAX_H3) == (37, 48, 84)
    assert tokens(1344, 768, 124, family=MINIMAX_H3) == 37 * 24 * 42 + 2 * 207 + 100
    assert tokens(1344, 768, 345, family=MINIMAX_H3) == MINIMAX_H3.max_tokens == (
        102 * 24 * 42 + 2 * 575 + 100)
    # The shapes measured through the pipeline, less their prompt's rows.
    for (width, height, num_frames), rows in (((64, 32, 124), 37 * 2 + 2 * 207),
                                              ((64, 64, 141), 42 * 4 + 2 * 235),
                                              ((96, 32, 175), 52 * 3 + 2 * 292)):
        assert tokens(width, height, num_frames, family=MINIMAX_H3) == rows + 100
    # Cosmos3: the video's patches and the prompt's rows, its template's and its own.
    assert tokens(1280, 720, 189, family=COSMOS3) == COSMOS3.max_tokens == 48 * 23 * 40 + 160
    assert tokens(64, 64, 9, family=COSMOS3) == 3 * 2 * 2 + 160
    assert tokens(96, 64, 13, family=COSMOS3) == 4 * 2 * 3 + 160


def _rows_per_forward(name: str, width: int, height: int, num_frames: int,
                      root: Path) -> list[tuple[int, int]]:
    """(rows the first block sees, the prompt's among them) for each forward of one step of a
    random-weight checkpoint of family ``name``."""
    # torch and the pipelines: the other tests of this module run without them.
    synthetic = pytest.importorskip("runtime.models.synthetic")
    base = pytest.importorskip("runtime.pipelines.base")
    registry = pytest.importorskip("runtime.pipelines.registry")
    model = synthetic.make_checkpoint(root / name, synthetic.SyntheticSpec(family=name))
    pipe = registry.load_diffusers(model)
    seen: list[int] = []
    try:
        if name == "cosmos3":  # a block runs the prompt's rows and the video's side by side
            block = pipe.pipe.transformer.layers[0]
            hook = block.register_forward_pre_hook(
                lambda _, args: seen.append(args[0].shape[0] + args[1].shape[0]))
        else:
            block = pipe.pipe.transformer.transformer_blocks[0]
            hook = block.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
        state = pipe.prepare(base.VideoRequest(
            prompt="a red circle moving left", negative_prompt="blurry", width=width,
            height=height, num_frames=num_frames, num_inference_steps=2,
            guidance_scale=5.0 if name == "cosmos3" else 1.0))
        pipe.step(state)
        hook.remove()
    finally:
        pipe.close()
    if name == "cosmos3":  # the CFG pair: each prompt's own rows
        prompts = [pack["und_len"] for pack in state.extra["packs"]]
    else:
        prompts = [state.extra["layout"]["text_indices"].numel()]
    return list(zip(seen, prompts, strict=True))


@pytest.mark.parametrize(("name", "family", "shape"), [
    ("cosmos3", COSMOS3, (96, 64, 13)), ("minimax-h3", MINIMAX_H3, (96, 32, 141))])
def test_tokens_are_the_rows_a_block_attends_over_with_the_prompt_the_job_has(
        tmp_path: Path, name: str, family: families.Family,
        shape: tuple[int, int, int]) -> None:
    forwards = _rows_per_forward(name, *shape, tmp_path)
    assert len(forwards) == (2 if name == "cosmos3" else 1)
    for rows, prompt_rows in forwards:
        assert rows == tokens(*shape, family=family) - family.prompt_rows + prompt_rows


def test_the_batcher_counts_tokens_with_the_family_function_the_api_bounds_jobs_by() -> None:
    assert cost.tokens is families.tokens


def _with_configs(path: Path, class_name: str, **configs: dict[str, Any]) -> str:
    model = _model_dir(path, class_name)
    for component, config in configs.items():
        (path / component).mkdir()
        (path / component / "config.json").write_text(json.dumps(config))
    return model


def test_a_checkpoint_family_takes_the_geometry_of_its_own_configs(tmp_path: Path) -> None:
    ti2v = checkpoint_family(_with_configs(
        tmp_path / "ti2v", "WanPipeline", vae={"scale_factor_spatial": 16,
                                               "scale_factor_temporal": 4},
        transformer={"patch_size": [1, 2, 2]}))
    assert (ti2v.name, ti2v.size_multiple, ti2v.frame_stride) == ("wan", 32, 4)
    assert ti2v.vae_scale_factor_spatial == 16
    assert tokens(1280, 704, 121, family=ti2v) == 31 * 22 * 40
    cog15 = checkpoint_family(_with_configs(
        tmp_path / "cog15", "CogVideoXPipeline",
        vae={"block_out_channels": [128, 256, 256, 512], "temporal_compression_ratio": 4},
        transformer={"patch_size": 2, "patch_size_t": 2}))
    assert (cog15.size_multiple, cog15.frame_stride, cog15.patch_size) == (16, 4, (2, 2, 2))
    # 81 frames: 21 latent frames, padded to 11 time patches.
    assert tokens(1360, 768, 81, family=cog15) == 11 * 48 * 85
    # No configs, or unreadable ones: the family's own numbers.
    assert checkpoint_family(_model_dir(tmp_path / "bare", "WanPipeline")) == WAN
    broken = _model_dir(tmp_path / "broken", "CogVideoXPipeline")
    (tmp_path / "broken" / "vae").mkdir()
    (tmp_path / "broken" / "vae" / "config.json").write_text("{not json")
    assert checkpoint_family(broken) == COGVIDEOX
    assert checkpoint_family("kiln-tiny") is TINY


@pytest.mark.parametrize("name", ["wan", "cogvideox"])
def test_a_checkpoint_family_reads_what_diffusers_reads_from_the_same_directory(
        tmp_path: Path, name: str) -> None:
    diffusers = pytest.importorskip("diffusers")
    synthetic = pytest.importorskip("runtime.models.synthetic")
    path = synthetic.make_checkpoint(tmp_path / name, synthetic.SyntheticSpec(family=name))
    # diffusers' pipeline derives the VAE's scale factors from the VAE it is given; the
    # transformer is built from its config, as the runtime builds it on the meta device.
    index = json.loads((path / "model_index.json").read_text())
    vae_class, transformer_class = (getattr(diffusers, index[c][1])
                                    for c in ("vae", "transformer"))
    pipe = getattr(diffusers, index["_class_name"])(
        vae=vae_class.from_pretrained(path, subfolder="vae"), transformer=None,
        text_encoder=None, tokenizer=None, scheduler=None)
    patch = transformer_class.from_config(
        transformer_class.load_config(path, subfolder="transformer")).config.patch_size
    family = checkpoint_family(str(path))
    spatial_patch = max(patch[1:]) if isinstance(patch, list | tuple) else patch
    # What runtime.pipelines.diffusers_video's size and frame check holds a request to.
    assert family.size_multiple == max(family_of(str(path)).size_multiple,
                                       pipe.vae_scale_factor_spatial * spatial_patch)
    assert family.frame_stride == pipe.vae_scale_factor_temporal

"""MiniMax-H3's soundtrack: kiln decodes the audio latents it denoised with the directory's audio
VAE exactly as diffusers' after-denoise step and ``decode.audio`` block do (CPU, fp32, bit for
bit), a local render writes it into its MP4, and a directory without an audio VAE renders the
video alone."""

from __future__ import annotations

import dataclasses
import shutil

import av
import pytest
import torch
from diffusers.modular_pipelines import MiniMaxH3Blocks, SequentialPipelineBlocks

from runtime.models.synthetic import SyntheticSpec, build_components, make_checkpoint
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.registry import load_diffusers
from runtime.render import render
from storage.video import read_audio

SPEC = SyntheticSpec(family="minimax-h3")
# 124 frames (5 s at 24 fps): 207 audio latents a channel, 165,600 samples.
REQUEST = VideoRequest(prompt="a red circle moving left", width=64, height=32, num_frames=124,
                       fps=24, num_inference_steps=3, seed=0, guidance_scale=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("models") / "minimax-h3", SPEC)


def diffusers_decode(state) -> tuple[torch.Tensor, int]:
    """diffusers' own blocks of the t2va workflow (its after-denoise step, then decode.audio) on
    ``state``'s denoised rows, with the same in-memory components the directory was saved from."""
    workflow = MiniMaxH3Blocks().get_workflow("t2va").sub_blocks
    blocks = SequentialPipelineBlocks.from_blocks_dict(
        {"after_denoise": workflow["denoise.after_denoise"], "audio": workflow["decode.audio"]})
    pipe = blocks.init_pipeline()
    pipe.update_components(**build_components(SPEC))
    frames, height, width = state.extra["shape"]
    out = pipe(latents=state.latents, audio_latents=state.extra["audio"],
               num_latent_frames=frames, latent_height=height, latent_width=width,
               num_audio_latents=state.extra["audio"].shape[0] // 2,
               output=["audio", "sampling_rate"])
    return out["audio"], out["sampling_rate"]


def test_the_soundtrack_equals_diffusers_decode_of_the_same_latents_bit_for_bit(model_dir):
    pipe = load_diffusers(model_dir)
    try:
        assert pipe.makes_audio
        state = pipe.prepare(REQUEST)
        while not state.done:
            pipe.step(state)
        samples, rate = pipe.decode_audio(state)
    finally:
        pipe.close()
    ref, ref_rate = diffusers_decode(state)
    assert ref.shape == (1, 2, 207 * 800)
    assert rate == ref_rate == 32_000
    assert samples.dtype == torch.float32 and samples.shape == (2, 207 * 800)
    assert torch.equal(samples, ref[0])
    assert samples.std() > 0.005 and not torch.equal(samples[0], samples[1])  # stereo sound


def test_a_directory_without_an_audio_vae_renders_the_video_alone(model_dir, tmp_path):
    copy = tmp_path / "no-audio"
    shutil.copytree(model_dir, copy)
    shutil.rmtree(copy / "audio_vae")
    pipe = load_diffusers(copy)
    try:
        assert not pipe.makes_audio
        state = pipe.prepare(dataclasses.replace(REQUEST, num_inference_steps=2))
        assert pipe.decode_audio(state) is None
    finally:
        pipe.close()


def test_a_local_render_writes_the_soundtrack_into_its_mp4(model_dir, tmp_path):
    [report] = render(str(model_dir), [REQUEST], tmp_path / "out.mp4")
    with av.open(report.out) as c:
        streams = {s.type: (s.codec_context.name, float(s.duration * s.time_base))
                   for s in c.streams}
    assert streams["video"][0] == "h264" and streams["audio"][0] == "aac"
    assert abs(streams["video"][1] - streams["audio"][1]) < 1 / REQUEST.fps
    assert read_audio(report.out).samples.shape == (2, 124 * 32_000 // 24)
    # Asked not to (kiln render --no-audio), the MP4 holds the video alone.
    [silent] = render(str(model_dir), [REQUEST], tmp_path / "silent.mp4", audio=False)
    with av.open(silent.out) as c:
        assert [s.type for s in c.streams] == ["video"]

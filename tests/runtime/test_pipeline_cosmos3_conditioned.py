"""Cosmos3 from a first frame or from the start of a clip, through DLO: kiln's frames equal
diffusers' own ``Cosmos3OmniPipeline`` given the same ``image`` or ``video``, prompt and seed, bit
for bit (CPU, fp32, the same thread count: kiln runs the reference's two forwards per step and
its ``prepare_latents``); at dp=2 two differently conditioned jobs side by side each render what
they render alone; a checkpoint of a conditioned job resumes bit for bit. Cosmos3 runs at sp=1
(``COSMOS3.sequence_parallel`` is off; test_pipeline_diffusers checks it is refused).

The model is a tiny random one (``runtime.models.synthetic``); the reference is diffusers'
pipeline built from the same in-memory components, given PIL pictures at the request's size.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch

from common.families import COSMOS3, checkpoint_family
from runtime.launch import rank_threads
from runtime.models.synthetic import SyntheticSpec, build_pipeline, make_checkpoint
from runtime.pipelines.base import Conditioning, VideoRequest
from runtime.pipelines.cosmos3 import CLIP_LATENT_FRAMES, Cosmos3VideoPipeline
from runtime.pipelines.reference import run_reference
from runtime.pipelines.registry import load_diffusers
from runtime.render import generate_on_ranks

SPEC = SyntheticSpec(family="cosmos3")


def picture(seed: int) -> torch.Tensor:
    """A uint8 [64, 64, 3] picture: gradients with noise, different per seed."""
    ramp = torch.linspace(0, 255, 64)
    base = torch.stack([ramp.expand(64, 64), ramp[:, None].expand(64, 64),
                        torch.full((64, 64), 40.0 * seed)], dim=-1)
    noise = torch.randint(-40, 41, (64, 64, 3), generator=torch.Generator().manual_seed(seed))
    return (base + noise).clamp(0, 255).to(torch.uint8)


def clip(seed: int, frames: int = 9) -> torch.Tensor:
    """A uint8 [frames, 64, 64, 3] clip: ``picture(seed)`` moving right."""
    return torch.stack([picture(seed).roll(4 * i, dims=1) for i in range(frames)])


CONDITIONS = {"image": lambda: Conditioning(image=picture(1)),
              "video": lambda: Conditioning(video=clip(1))}


def request(kind: str | None, **changes) -> VideoRequest:
    """Nine frames (three latent frames) of 64x64 in three steps: an image conditions the
    first latent frame, a video the first two."""
    base = VideoRequest(prompt="a red circle moving left", negative_prompt="blurry", width=64,
                        height=64, num_frames=9, num_inference_steps=3, seed=0,
                        guidance_scale=5.0,
                        conditioning=None if kind is None else CONDITIONS[kind]())
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("models") / "cosmos3", SPEC)


def reference_frames(r: VideoRequest) -> np.ndarray:
    """diffusers' ``Cosmos3OmniPipeline`` on ``r``, from the same in-memory components."""
    pipe = build_pipeline(SPEC)
    pipe.set_progress_bar_config(disable=True)
    return run_reference(pipe, COSMOS3.name, r)


def kiln_frames(model_dir, r: VideoRequest) -> np.ndarray:
    pipe = load_diffusers(model_dir)
    try:
        return pipe.generate(r).numpy()
    finally:
        pipe.close()


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_conditioned_render_equals_the_diffusers_pipeline_bit_for_bit(model_dir, kind):
    pipe = load_diffusers(model_dir)
    try:
        assert isinstance(pipe, Cosmos3VideoPipeline) and pipe.forwards_per_step == 2
        # streamed: outside a forward the blocks hold nothing
        assert all(p.is_meta for p in pipe.transformers[0].layers.parameters())
        frames = pipe.generate(request(kind)).numpy()
    finally:
        pipe.close()
    ref = reference_frames(request(kind))
    assert frames.shape == ref.shape == (9, 64, 64, 3)
    assert ref.std() > 0.01  # a real picture, not a constant
    np.testing.assert_array_equal(frames, ref)


def test_without_guidance_a_conditioned_render_equals_the_diffusers_pipeline(model_dir):
    # One forward a step (the second's gathers issued without computing).
    r = request("video", guidance_scale=1.0)
    np.testing.assert_array_equal(kiln_frames(model_dir, r), reference_frames(r))


def test_the_given_latent_frames_stay_as_encoded_and_the_rest_are_rendered(model_dir):
    pipe = load_diffusers(model_dir)
    try:
        for kind, given in (("image", 1), ("video", 2)):
            r = request(kind, num_frames=13)  # four latent frames
            state = pipe.prepare(r)
            assert state.extra["mask"].flatten().tolist() == [1.0] * given + [0.0] * (4 - given)
            start = state.latents.clone()
            while not state.done:
                pipe.step(state)
            moved = (state.latents - start).abs().amax(dim=(0, 1, 3, 4))
            # The scheduler's step of a zero velocity changes them by rounding only (4.5e-8
            # measured), while the noise becomes a video.
            assert moved[:given].max() < 1e-6 and moved[given:].min() > 0.1
    finally:
        pipe.close()


def test_the_picture_changes_the_video(model_dir):
    pipe = load_diffusers(model_dir)
    try:
        text = pipe.generate(request(None)).numpy()
        renders = [pipe.generate(r).numpy() for r in (
            request("image"), request("image", conditioning=Conditioning(image=picture(2))),
            request("video"), request("video", conditioning=Conditioning(video=clip(2))))]
    finally:
        pipe.close()
    for i, a in enumerate([text, *renders]):
        for b in renders[i:]:
            assert a is b or not np.array_equal(a, b)


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
def test_a_clip_of_other_lengths_conditions_as_the_reference_does(model_dir):
    # The reference keeps a clip's first 5 frames and repeats its last to fill a shorter one:
    # a 3-frame clip, and a 13-frame clip (longer than the render) both go through.
    for frames in (3, 13):
        r = request("video", conditioning=Conditioning(video=clip(3, frames)))
        np.testing.assert_array_equal(kiln_frames(model_dir, r), reference_frames(r))


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
@pytest.mark.slow
def test_two_ranks_render_two_differently_conditioned_jobs_each_as_alone(model_dir):
    # An image on rank 0, a clip on rank 1, with different prompts and seeds; each block
    # gathered once per forward for both (allgather).
    requests = [request("image"),
                request("video", prompt="a blue cat flying over the sea", seed=7,
                        conditioning=Conditioning(video=clip(2)))]
    frames = generate_on_ranks(str(model_dir), requests, dp=2, timeout_s=180)
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))  # as on each rank: kernels split sums by threads
    try:
        alone = [kiln_frames(model_dir, r) for r in requests]
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(frames, alone, strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(alone[0], alone[1])


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_checkpoint_of_a_conditioned_job_resumes_bit_for_bit(model_dir, kind):
    pipe = load_diffusers(model_dir)
    try:
        r = request(kind)
        whole = pipe.generate(r)
        state = pipe.prepare(r)
        pipe.step(state)
        tensors, values = pipe.resume_tensors(state), pipe.resume_values(state)
        # The mask and the packs are the request's: prepare rebuilds them.
        assert not any("mask" in k or "packs" in k for k in tensors)
        resumed = pipe.prepare(r)
        pipe.load_resume(resumed, tensors, values)
        assert resumed.step_index == 1
        while not resumed.done:
            pipe.step(resumed)
        assert torch.equal(pipe.decode(resumed), whole)
    finally:
        pipe.close()


def test_what_cosmos3_cannot_render_from_is_refused_saying_why(model_dir):
    pipe = load_diffusers(model_dir)
    try:
        cases = [
            (Conditioning(image=picture(1), video=clip(1)), {}, "an image or a video, not both"),
            (Conditioning(image=picture(1), last_image=picture(2)), {}, "not from a last image"),
            (Conditioning(video=clip(1), strength=0.5), {}, "first 5 frames .* no strength"),
            (Conditioning(image=picture(1)[:48]), {},
             r"uint8 \[64, 64, 3\], fitted .* \[48, 64, 3\]"),
            (Conditioning(video=clip(1)[:, :48]), {},
             r"uint8 \[frames, 64, 64, 3\], fitted .* \[9, 48, 64, 3\]"),
            (Conditioning(video=clip(1).float()), {}, "must be uint8"),
            (Conditioning(video=clip(1)), {"num_frames": 5}, "first 5 frames; .* got 5"),
            (Conditioning(image=picture(1)), {"num_frames": 1}, "single frame renders from text"),
        ]
        for conditioning, changes, message in cases:
            with pytest.raises(ValueError, match=message):
                pipe.prepare(request(None, conditioning=conditioning, **changes))
    finally:
        pipe.close()


def test_cosmos3_takes_an_image_or_a_video_as_its_pipeline_does(model_dir):
    diffusers = pytest.importorskip("diffusers")
    assert COSMOS3.inputs == {"image", "video"} and not COSMOS3.needs_input
    assert checkpoint_family(str(model_dir)).inputs == {"image", "video"}
    params = inspect.signature(diffusers.Cosmos3OmniPipeline.__call__).parameters
    assert {"image", "video"} <= set(params)
    # The latent frames a clip conditions, which kiln keeps: the reference's default.
    assert tuple(params["condition_frame_indexes_vision"].default) == CLIP_LATENT_FRAMES

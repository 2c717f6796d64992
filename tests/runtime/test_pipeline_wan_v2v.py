"""Wan video-to-video through DLO: a Wan2.1 text-to-video directory given a clip and a strength
renders what diffusers' ``WanVideoToVideoPipeline`` renders from the same directory's components,
bit for bit with the reference's two batch-1 CFG forwards (``cfg_batch=False``), to ``WAN_ATOL``
with kiln's batch-2 one; at dp=2 two clips of different strengths (so different step counts)
render side by side as each does alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from common.families import WAN, checkpoint_family
from runtime.launch import rank_threads
from runtime.models.synthetic import SyntheticSpec, build_pipeline, make_checkpoint
from runtime.pipelines.base import Conditioning, VideoRequest
from runtime.pipelines.reference import run_reference
from runtime.pipelines.registry import load_diffusers
from runtime.render import generate_on_ranks

SPEC = SyntheticSpec(family="wan")
# See test_pipeline_diffusers.WAN_ATOL (measured here: 7.7e-7, 8.6e-7 and 6.0e-7 at strength
# 0.8, 0.5 and 1.0; CPU, fp32).
WAN_ATOL = 1e-5


def clip(seed: int) -> torch.Tensor:
    """A uint8 [9, 64, 64, 3] clip: a gradient moving right, with noise."""
    ramp = torch.linspace(0, 255, 64)
    frames = [torch.stack([ramp.roll(4 * i).expand(64, 64), ramp[:, None].expand(64, 64),
                           torch.full((64, 64), 30.0 * seed)], dim=-1) for i in range(9)]
    noise = torch.randint(-30, 31, (9, 64, 64, 3), generator=torch.Generator().manual_seed(seed))
    return (torch.stack(frames) + noise).clamp(0, 255).to(torch.uint8)


def request(strength: float | None = 0.5, clip_seed: int = 1, **changes) -> VideoRequest:
    base = VideoRequest(prompt="a red circle moving left", negative_prompt="blurry", width=64,
                        height=64, num_frames=9, num_inference_steps=4, seed=0,
                        guidance_scale=5.0,
                        conditioning=Conditioning(video=clip(clip_seed), strength=strength))
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"wan": make_checkpoint(root / "wan", SPEC),
            "wan22": make_checkpoint(root / "wan22", SyntheticSpec(family="wan", num_experts=2))}


def reference_frames(r: VideoRequest) -> np.ndarray:
    """diffusers' ``WanVideoToVideoPipeline`` on ``r``, around the same in-memory components."""
    return run_reference(build_pipeline(SPEC), WAN.name, r)


def kiln_frames(model_dir, r: VideoRequest, **load) -> np.ndarray:
    pipe = load_diffusers(model_dir, **load)
    try:
        return pipe.generate(r).numpy()
    finally:
        pipe.close()


# strength None: the reference's default, 0.8 (3 of 4 steps); 0.5: 2 steps; 1.0: all 4.
@pytest.mark.parametrize(("strength", "steps"), [(None, 3), (0.5, 2), (1.0, 4)])
def test_v2v_with_two_batch_1_cfg_forwards_equals_the_diffusers_pipeline_bit_for_bit(
        model_dirs, strength, steps):
    pipe = load_diffusers(model_dirs["wan"], cfg_batch=False)
    try:
        assert pipe.prepare(request(strength)).num_inference_steps == steps
        frames = pipe.generate(request(strength)).numpy()
    finally:
        pipe.close()
    ref = reference_frames(request(strength))
    assert frames.shape == ref.shape == (9, 64, 64, 3) and ref.std() > 0.01
    np.testing.assert_array_equal(frames, ref)


def test_v2v_with_the_batch_2_cfg_forward_matches_the_diffusers_pipeline(model_dirs):
    frames = kiln_frames(model_dirs["wan"], request())
    np.testing.assert_allclose(frames, reference_frames(request()), rtol=0, atol=WAN_ATOL)


def test_the_strength_and_the_clip_both_change_the_video(model_dirs):
    pipe = load_diffusers(model_dirs["wan"])
    try:
        base = pipe.generate(request()).numpy()
        for other in (request(0.8), request(clip_seed=2)):
            assert not np.array_equal(pipe.generate(other).numpy(), base)
    finally:
        pipe.close()


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
@pytest.mark.slow
def test_two_ranks_render_two_clips_of_different_strengths_each_as_alone(model_dirs):
    # 4 steps on rank 0, 2 on rank 1 (which idles the last two), one gather per block shared.
    requests = [request(1.0),
                request(0.5, clip_seed=2, seed=7, prompt="a blue cat flying over the sea")]
    frames = generate_on_ranks(str(model_dirs["wan"]), requests, dp=2, timeout_s=180)
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))  # as on each rank: kernels split sums by threads
    try:
        alone = [kiln_frames(model_dirs["wan"], r) for r in requests]
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(frames, alone, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_checkpoint_of_a_v2v_job_resumes_bit_for_bit(model_dirs):
    pipe = load_diffusers(model_dirs["wan"])
    try:
        r = request(0.8)
        whole = pipe.generate(r)
        state = pipe.prepare(r)
        pipe.step(state)
        resumed = pipe.prepare(r)
        pipe.load_resume(resumed, pipe.resume_tensors(state), pipe.resume_values(state))
        assert resumed.step_index == 1 and resumed.num_inference_steps == 3
        while not resumed.done:
            pipe.step(resumed)
        assert torch.equal(pipe.decode(resumed), whole)
    finally:
        pipe.close()


def test_what_video_to_video_cannot_render_is_refused_saying_why(model_dirs):
    wan, wan22 = load_diffusers(model_dirs["wan"]), load_diffusers(model_dirs["wan22"])
    try:
        with pytest.raises(ValueError, match="strength 0.2 of 4 steps runs no step; .* 0.25"):
            wan.prepare(request(0.2))
        with pytest.raises(ValueError, match=r"uint8 \[9, 64, 64, 3\].* \[5, 64, 64, 3\]"):
            wan.prepare(request(conditioning=Conditioning(video=clip(1)[:5])))
        with pytest.raises(ValueError, match="not from an image"):
            wan.prepare(request(conditioning=Conditioning(image=clip(1)[0])))
        with pytest.raises(ValueError, match="renders Wan2.1 models"):
            wan22.prepare(request())
    finally:
        wan.close()
        wan22.close()


def test_a_wan21_checkpoint_takes_a_video_and_a_wan22_one_none(model_dirs):
    assert WAN.inputs == {"video"} and not WAN.needs_input
    assert checkpoint_family(str(model_dirs["wan"])).inputs == {"video"}
    assert checkpoint_family(str(model_dirs["wan22"])).inputs == frozenset()


@pytest.mark.chaos  # two ranks: make chaos runs it beside the other multi-rank V2V case
def test_v2v_at_sp2_renders_what_one_rank_does_bit_for_bit(model_dirs):
    # 48x48: 3 x 3 x 3 = 27 tokens, which sp=2 does not divide.
    r = request(width=48, height=48,
                conditioning=Conditioning(video=clip(1)[:, :48, :48].contiguous(), strength=0.5))
    split = generate_on_ranks(str(model_dirs["wan"]), [r], dp=1, sp=2, timeout_s=180)
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))
    try:
        alone = kiln_frames(model_dirs["wan"], r)
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(split[0], alone)
    np.testing.assert_array_equal(split[1], alone)  # the replica's ranks hold one video

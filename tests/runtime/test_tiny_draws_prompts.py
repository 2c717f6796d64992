"""kiln-tiny's trained weights draw what the prompt says, rendered the way the service renders:
two ranks over gloo sharing the streamed blocks (DLO, all-gather), the request's defaults."""

from __future__ import annotations

import torch

from runtime.models.shapes import COLOURS, DIRECTIONS, describe, sample_clips
from runtime.models.tiny import encode_video
from runtime.pipelines.base import DenoiseState, VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from runtime.render import TINY_MODEL, generate_in_rounds

# Every colour twice, every shape four times, every direction three times.
CASES = [
    ("red", "circle", "left"), ("red", "square", "up"),
    ("green", "square", "right"), ("green", "triangle", "down"),
    ("blue", "triangle", "up"), ("blue", "circle", "right"),
    ("yellow", "circle", "down"), ("yellow", "triangle", "left"),
    ("purple", "square", "down"), ("purple", "circle", "up"),
    ("cyan", "triangle", "right"), ("cyan", "square", "left"),
]


def test_twelve_prompts_on_two_ranks_give_the_asked_colour_and_direction_at_least_ten_times():
    # The shipped weights, not the random initialisation (which draws noise).
    assert {c for c, _, _ in CASES} == set(COLOURS)
    requests = [VideoRequest(prompt=f"a {colour} {shape} moving {direction}", seed=i)
                for i, (colour, shape, direction) in enumerate(CASES)]
    frames = generate_in_rounds(TINY_MODEL, requests, dp=2, timeout_s=300)
    num_right = 0
    for request, (colour, _, direction), clip in zip(requests, CASES, frames, strict=True):
        assert clip.shape == (9, 64, 64, 3)
        got = describe(torch.from_numpy(clip))
        right = got == (colour, direction)
        num_right += right
        print(f"{request.prompt!r}: colour {got[0]}, direction {got[1]} -> "
              f"{'right' if right else 'WRONG'}")
    print(f"{num_right} of {len(CASES)} right")
    assert num_right >= 10


def test_trained_decoder_draws_encoded_clips_back_close_to_the_originals():
    pipe = TinyPipeline.load(offload=False)
    clips = sample_clips(8, torch.Generator().manual_seed(7))
    for video, colour, motion in zip(clips.video_BNHW3, clips.colour, clips.motion,
                                     strict=True):
        latents = encode_video(pipe.cfg, video[None])
        state = DenoiseState(request=VideoRequest(prompt=""), latents=latents,
                             num_inference_steps=0)
        frames = pipe.decode(state)
        assert frames.shape == (9, 64, 64, 3)
        assert (frames - (video + 1) / 2).abs().mean() < 0.03  # in [0, 1]: about 8 of 255
        got_colour, got_direction = describe(frames)
        assert got_colour == colour
        assert got_direction == motion or motion not in DIRECTIONS

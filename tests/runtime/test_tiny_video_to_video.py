"""kiln-tiny video-to-video (``Conditioning.video``), SDEdit's way: the clip's latents noised to
where the last ``strength`` of the schedule begins, and only those steps run. What remix and edit
of a kiln-tiny video do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.pipelines.base import Conditioning, VideoRequest
from runtime.pipelines.tiny import TinyPipeline, video_start


@pytest.fixture(scope="module")
def pipe() -> TinyPipeline:
    return TinyPipeline.load(offload=False)


def _clip() -> torch.Tensor:
    """9 frames of a red square standing right of centre on grey."""
    frame = np.full((64, 64, 3), 80, np.uint8)
    frame[24:40, 36:52] = (220, 40, 40)
    return torch.from_numpy(frame)[None].expand(9, -1, -1, -1).contiguous()


def _render(pipe: TinyPipeline, request: VideoRequest) -> tuple[torch.Tensor, int]:
    state = pipe.prepare(request)
    steps = state.num_inference_steps
    while not state.done:
        pipe.step(state)
    return pipe.decode(state), steps


def _red_x(frame: torch.Tensor) -> float:
    f = (frame * 255).numpy()
    xs = np.nonzero((f[..., 0] > 150) & (f[..., 1] < 110))[1]
    return float(xs.mean()) if len(xs) else float("nan")


def test_the_start_follows_diffusers_rule() -> None:
    assert [video_start(4, s) for s in (1.0, 0.8, 0.5, 0.25)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="runs no step of 4; give at least 0.25"):
        video_start(4, 0.2)


def test_strength_1_is_the_text_render_and_less_keeps_the_clip(pipe: TinyPipeline) -> None:
    text = VideoRequest(prompt="a red circle moving left", seed=3, num_inference_steps=8)
    clip = _clip()
    plain, steps = _render(pipe, text)
    full, full_steps = _render(pipe, VideoRequest(
        prompt=text.prompt, seed=3, num_inference_steps=8,
        conditioning=Conditioning(video=clip, strength=1.0)))
    assert torch.equal(full, plain) and full_steps == steps == 8
    half, half_steps = _render(pipe, VideoRequest(
        prompt="a red square moving left", seed=3, num_inference_steps=8,
        conditioning=Conditioning(video=clip, strength=0.5)))
    assert half_steps == 4
    # Half the schedule from the clip: its first frame keeps the square where the clip has it.
    assert abs(_red_x(half[0]) - 43.5) < 3


def test_a_clip_of_another_length_or_with_an_image_is_refused(pipe: TinyPipeline) -> None:
    clip = _clip()
    with pytest.raises(ValueError, match="the video must be"):
        pipe.prepare(VideoRequest(prompt="p", conditioning=Conditioning(video=clip[:5])))
    with pytest.raises(ValueError, match="not both"):
        pipe.prepare(VideoRequest(prompt="p", conditioning=Conditioning(video=clip,
                                                                        image=clip[0])))

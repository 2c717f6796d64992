"""`kiln up` serves MiniMax-H3's soundtrack end to end: a random-weight MiniMax-H3 directory
(``kiln make-checkpoint``'s, with its audio VAE), a job submitted over HTTP, rendered by a
``--dp 2`` group; the MP4 it serves has an H.264 and an AAC stream as long as each other, whose
sound is the one a local render of the same request gives, and the job says it has sound. A job
that asks for no sound gets the video alone."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import pytest
import torch
from servers import kiln_up

from runtime.launch import rank_threads
from runtime.models.synthetic import SyntheticSpec, make_checkpoint
from runtime.pipelines.base import VideoRequest
from runtime.render import frames_to_uint8, load_pipeline, soundtrack
from storage.video import read_audio, write_video

# MiniMax-H3 at its fewest frames (5 s at 24 fps) on sizes of 32, without guidance.
JOB: dict[str, Any] = {"prompt": "a red circle moving left", "seed": 7, "width": 64,
                       "height": 32, "num_frames": 124, "num_inference_steps": 3, "fps": 24}


def _local_sound(model: str, out: Path) -> np.ndarray:
    """The same request rendered here (with the threads one rank of the group computes with),
    written as the worker writes it, its sound decoded again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))
    pipe = load_pipeline(model)
    try:
        state = pipe.prepare(VideoRequest(**JOB))
        while not state.done:
            pipe.step(state)
        frames = frames_to_uint8(pipe.decode(state)).numpy()
        sound = soundtrack(pipe, state)
    finally:
        pipe.close()
        torch.set_num_threads(threads)
    assert sound is not None
    return read_audio(write_video(frames, out, fps=JOB["fps"], audio=sound)).samples


def _streams(path: Path) -> list[tuple[str, float]]:
    with av.open(str(path)) as c:
        return [(s.codec_context.name, float(s.duration * s.time_base)) for s in c.streams]


def _render(base: str, headers: dict[str, str], body: dict[str, Any], out: Path) -> dict:
    created = httpx.post(f"{base}/v1/jobs", json=body, headers=headers, timeout=30)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    seen = [created.json()]
    deadline = time.monotonic() + 300  # the group loads the model meanwhile
    while seen[-1]["status"] not in ("succeeded", "failed", "dead"):
        assert time.monotonic() < deadline, seen[-1]
        time.sleep(0.2)
        seen.append(httpx.get(f"{base}/v1/jobs/{job_id}", headers=headers, timeout=30).json())
    assert seen[-1]["status"] == "succeeded", seen[-1]
    video = httpx.get(f"{base}/v1/jobs/{job_id}/video", headers=headers, timeout=30)
    assert video.status_code == 200
    out.write_bytes(video.content)
    return seen[-1]


@pytest.mark.slow
@pytest.mark.chaos  # a kiln up: `make chaos` runs it, `make test` does not
def test_kiln_up_serves_minimax_h3_with_its_soundtrack(tmp_path: Path) -> None:
    model = str(make_checkpoint(tmp_path / "minimax-h3", SyntheticSpec(family="minimax-h3")))
    with kiln_up(tmp_path, "--dp", "2", "--model", model) as (base, key):
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": model, **JOB}
        with_sound = _render(base, headers, body, tmp_path / "sound.mp4")
        silent = _render(base, headers, {**body, "audio": False}, tmp_path / "silent.mp4")
    assert with_sound["has_audio"] is True and silent["has_audio"] is False
    (video, video_s), (audio, audio_s) = _streams(tmp_path / "sound.mp4")
    assert (video, audio) == ("h264", "aac")
    assert abs(video_s - audio_s) < 1 / JOB["fps"]
    # AAC encodes the same samples to the same stream: the served sound is the local one.
    served = read_audio(tmp_path / "sound.mp4")
    assert served.sample_rate == 32_000 and served.samples.shape == (2, 124 * 32_000 // 24)
    assert np.array_equal(served.samples, _local_sound(model, tmp_path / "local.mp4"))
    assert [codec for codec, _ in _streams(tmp_path / "silent.mp4")] == ["h264"]

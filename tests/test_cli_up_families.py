"""`kiln up --model DIR` serves each diffusers family beyond Wan and CogVideoX end to end: a
random-weight Cosmos3 and MiniMax-H3 directory (``kiln make-checkpoint``'s), a job submitted over
HTTP with the family's own rules, rendered by a ``--dp 2`` group sharing the weights, its MP4
downloaded and decoded; the served frames are the ones a local render of the same request gives.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from servers import decoded, kiln_up
from typer.testing import CliRunner

from kiln.cli import app
from runtime.launch import rank_threads
from runtime.models.synthetic import SyntheticSpec, make_checkpoint
from runtime.pipelines.base import VideoRequest
from runtime.render import frames_to_uint8, load_pipeline
from storage.video import write_outputs

# A small clip each family renders: Cosmos3 with its CFG pair; MiniMax-H3 at its fewest frames
# (5 s at 24 fps) on sizes of 32, without guidance (it is distilled).
JOBS: dict[str, dict[str, Any]] = {
    "cosmos3": {"width": 64, "height": 64, "num_frames": 9, "num_inference_steps": 3,
                "guidance_scale": 5.0, "negative_prompt": "blurry", "fps": 8},
    "minimax-h3": {"width": 64, "height": 32, "num_frames": 124, "num_inference_steps": 3,
                   "fps": 24},
}


def _local_video(model: str, body: dict[str, Any], out: Path) -> np.ndarray:
    """The same request rendered here, with the threads one rank of the group computes with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))
    pipe = load_pipeline(model)
    try:
        fields = {k: v for k, v in body.items() if k != "model"}
        frames = frames_to_uint8(pipe.generate(VideoRequest(**fields))).numpy()
    finally:
        pipe.close()
        torch.set_num_threads(threads)
    local, _ = write_outputs(frames, out, fps=body["fps"])
    return decoded(Path(local))


@pytest.mark.slow
@pytest.mark.chaos  # a kiln up per family: `make chaos` runs them, `make test` does not
@pytest.mark.parametrize("family", list(JOBS))
def test_kiln_up_serves_the_family_end_to_end(tmp_path: Path, family: str) -> None:
    model = str(make_checkpoint(tmp_path / family, SyntheticSpec(family=family)))
    with kiln_up(tmp_path, "--dp", "2", "--model", model) as (base, key):
        headers = {"Authorization": f"Bearer {key}"}
        served = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"]
        assert [(m["id"], m["family"]) for m in served] == [(model, family)]
        body = {"model": model, "prompt": "a red circle moving left", "seed": 7,
                **JOBS[family]}
        created = httpx.post(f"{base}/v1/jobs", json=body, headers=headers, timeout=30)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        seen = []
        deadline = time.monotonic() + 300  # the group loads the model meanwhile
        while not seen or seen[-1]["status"] not in ("succeeded", "failed", "dead"):
            assert time.monotonic() < deadline, seen[-1:]
            seen.append(httpx.get(f"{base}/v1/jobs/{job_id}", headers=headers,
                                  timeout=30).json())
            time.sleep(0.2)
        assert seen[-1]["status"] == "succeeded", seen[-1]
        video = httpx.get(f"{base}/v1/jobs/{job_id}/video", headers=headers, timeout=30)
        assert video.status_code == 200
        path = tmp_path / "served.mp4"
        path.write_bytes(video.content)
    frames = decoded(path)
    assert frames.shape == (body["num_frames"], body["height"], body["width"], 3)
    assert np.array_equal(frames, _local_video(model, body, tmp_path / "local.mp4"))


def test_sp_above_1_for_a_family_that_runs_at_sp_1_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text('{"_class_name": "Cosmos3OmniPipeline"}')
    for command in ("up", "worker"):
        result = CliRunner().invoke(app, [command, "--model", str(tmp_path), "--sp", "2"])
        assert result.exit_code == 2, result.output
        words = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())  # no error box
        assert ("Invalid value for --sp: cosmos3 runs at --sp 1; sequence parallelism renders "
                "kiln-tiny, wan, minimax-h3") in words, words

"""Admission at the door: a request is held at submit to its model family's size and frame rules
and to the largest job the deployment accepts, so what passes validation is what can start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.jobs import spec_from_job_create, spec_from_video_create
from api.schemas import JobCreate, VideoCreate
from common.families import TINY, tokens
from common.settings import Settings
from runtime.models.tiny import TinyConfig
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from storage.submission import JobSpec
from storage.tables import utcnow

OK_BODY = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
           "num_inference_steps": 4}


def _settings(**overrides: Any) -> Settings:
    return Settings(_env_file=None, **overrides)  # type: ignore[arg-type]


def _job(s: Settings, **fields: Any) -> JobSpec | list[dict[str, Any]]:
    """The checked spec of a native request, or its errors as (field, message)."""
    try:
        return spec_from_job_create(JobCreate(**{**OK_BODY, **fields}), s, utcnow())
    except RequestValidationError as exc:
        return [{"field": ".".join(map(str, e["loc"][1:])) or "body", "msg": e["msg"]}
                for e in exc.errors()]


def _video(s: Settings, **fields: Any) -> JobSpec | list[dict[str, Any]]:
    try:
        return spec_from_video_create(VideoCreate(prompt="a red circle", **fields), s, utcnow())
    except RequestValidationError as exc:
        return [{"field": ".".join(map(str, e["loc"][1:])) or "body", "msg": e["msg"]}
                for e in exc.errors()]


def _post(api, path: str = "/v1/jobs", **body: Any):  # noqa: ANN001, ANN202
    if path == "/v1/jobs":
        return api.client.post(path, json={**OK_BODY, **body}, headers=api.auth("alice"))
    return api.client.post(path, json={"prompt": "a red circle", **body},
                           headers=api.auth("alice"))


@pytest.mark.parametrize("field,value,message", [
    ("width", 72, "must be a multiple of 16, got 72; nearest: 64 or 80"),
    ("height", 40, "must be a multiple of 16, got 40; nearest: 32 or 48"),
    ("width", 1912, "must be a multiple of 16, got 1912; nearest: 1904 or 1920"),
    ("height", 24, "must be a multiple of 16, got 24; nearest: 16 or 32"),
])
def test_a_multiple_of_8_that_is_not_one_of_16_is_refused_naming_the_rule_and_nearest_sizes(
        api, field: str, value: int, message: str) -> None:  # noqa: ANN001
    before = api.snapshot()
    r = _post(api, **{field: value})
    assert r.status_code == 422
    assert r.json()["detail"] == f"{field}: {message}"
    assert r.json()["error"]["param"] == field
    assert api.snapshot() == before


@pytest.mark.parametrize("num_frames,nearest", [(2, "1 or 5"), (8, "5 or 9"), (10, "9 or 13"),
                                                (256, "253 or 257")])
def test_a_frame_count_off_the_rule_is_refused_naming_the_nearest_counts(
        api, num_frames: int, nearest: str) -> None:  # noqa: ANN001
    r = _post(api, num_frames=num_frames)
    assert r.status_code == 422
    assert r.json()["detail"] == (f"num_frames: must be 1 + a multiple of 4 frames "
                                  f"(1, 5, 9, ...), got {num_frames}; nearest: {nearest}")


def test_a_job_over_the_token_bound_is_refused_naming_the_limit_its_size_and_the_way_under(
        api) -> None:  # noqa: ANN001
    before = api.snapshot()
    r = _post(api, width=1920, height=1920, num_frames=9)
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "body"
    assert r.json()["detail"] == (
        "body: the job is too large: 1920x1920, 9 frames is 43,200 video tokens per step, over "
        "this deployment's max_job_tokens of 16,384; use fewer frames (at most 1 at 1920x1920) "
        "or a smaller size")
    assert api.snapshot() == before
    assert _post(api, width=1920, height=1920, num_frames=1).status_code == 201


def test_a_job_over_the_work_bound_is_refused_saying_how_many_steps_fit(api) -> None:  # noqa: ANN001
    r = _post(api, width=1024, height=1024, num_frames=13, num_inference_steps=51)
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "body: the job is too large: 1024x1024, 13 frames is 16,384 video tokens x 51 steps = "
        "835,584, over this deployment's max_job_work of 819,200; use fewer steps (at most 50 "
        "at 1024x1024, 13 frames), a smaller size or fewer frames")
    assert _post(api, width=1024, height=1024, num_frames=13,
                 num_inference_steps=50).status_code == 201


def test_openai_sizes_and_lengths_are_held_to_the_same_rules(api) -> None:  # noqa: ANN001
    before = api.snapshot()
    r = _post(api, "/v1/videos", size="1912x1080")
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "size"
    assert r.json()["detail"] == ("size: width must be a multiple of 16, got 1912; nearest: "
                                  "1904 or 1920; size: height must be a multiple of 16, got "
                                  "1080; nearest: 1072 or 1088")
    r = _post(api, "/v1/videos", size="1024x1024", seconds="2")
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "body: the job is too large: 1024x1024, 17 frames is 20,480 video tokens per step, over "
        "this deployment's max_job_tokens of 16,384; use fewer seconds (at most 1 at 1024x1024) "
        "or a smaller size")
    r = _post(api, "/v1/videos", seconds="9999")
    assert r.status_code == 422
    assert r.json()["detail"].startswith("seconds: at most 32 s at 8 fps (257 frames)")
    assert api.snapshot() == before
    assert _post(api, "/v1/videos", size="1280x720", seconds="1").status_code == 200


def test_the_stricter_of_the_family_and_the_deployment_rule_holds() -> None:
    s = _settings(size_multiple=24, frame_stride=3)  # with kiln-tiny's 16 and 4: 48 and 12
    assert isinstance(_job(s, width=1920, height=96, num_frames=13), JobSpec)
    assert _job(s, width=1904, height=96, num_frames=13) == [
        {"field": "width", "msg": "must be a multiple of 48, got 1904; nearest: 1872 or 1920"}]
    assert _job(s, width=96, height=96, num_frames=9) == [
        {"field": "num_frames",
         "msg": "must be 1 + a multiple of 12 frames (1, 13, 25, ...), got 9; nearest: 1 or 13"}]
    # The OpenAI conversion lands on that stride: 1 s at 8 fps is 1 + 12 frames, not 1 + 8.
    spec = _video(s, size="96x96", seconds="1")
    assert isinstance(spec, JobSpec) and spec.num_frames == 13


def test_seconds_become_a_frame_count_the_model_renders_at_every_fps() -> None:
    s, cfg = _settings(), TinyConfig()
    for fps in range(1, s.max_fps + 1):
        for seconds in (1, 2, 3, 5, 8):
            spec = _video(s, seconds=str(seconds), fps=fps)
            if not isinstance(spec, JobSpec):  # longer than max_num_frames
                assert 1 + seconds * fps > s.max_num_frames, (fps, seconds, spec)
                assert [e["field"] for e in spec] == ["seconds"]
                continue
            cfg.check_video_size(spec.width, spec.height, spec.num_frames)
            assert 0 <= spec.num_frames - (1 + seconds * fps) < TINY.frame_stride


def _accepts(s: Settings, **fields: Any) -> bool:
    return isinstance(_job(s, **fields), JobSpec)


def _renders(width: int, height: int, num_frames: int) -> bool:
    try:
        TinyConfig().check_video_size(width, height, num_frames)
    except ValueError:
        return False
    return True


def test_kiln_tiny_sizes_and_lengths_the_api_accepts_are_exactly_those_its_pipeline_renders(
) -> None:
    s = _settings()
    for width in range(s.min_size, s.max_width + 1):
        assert _accepts(s, width=width) == _renders(width, 64, 9), width
    for num_frames in range(1, s.max_num_frames + 1):
        assert _accepts(s, num_frames=num_frames) == _renders(64, 64, num_frames), num_frames


@pytest.fixture(scope="module")
def tiny_pipeline() -> TinyPipeline:
    return TinyPipeline.load(offload=False)


@pytest.mark.parametrize("width,height", [(1920, 1920), (1024, 1024), (1920, 128), (16, 16)])
def test_the_largest_kiln_tiny_job_the_api_accepts_at_a_size_prepares_on_the_pipeline(
        tiny_pipeline: TinyPipeline, width: int, height: int) -> None:
    s = _settings()
    accepted = [n for n in range(1, s.max_num_frames + 1, TINY.frame_stride)
                if _accepts(s, width=width, height=height, num_frames=n)]
    most = max(accepted)
    expected = {(1920, 1920): 1, (1024, 1024): 13, (1920, 128): 65, (16, 16): 257}
    assert most == expected[(width, height)]
    # Unset in the settings: kiln-tiny's own bound.
    max_tokens = s.max_job_tokens or TINY.max_tokens
    max_work = s.max_job_work or 50 * max_tokens
    num_tokens = tokens(width, height, most, family=TINY)
    assert num_tokens <= max_tokens
    if most < s.max_num_frames:  # one stride more is over the bound, and refused for it
        assert tokens(width, height, most + TINY.frame_stride, family=TINY) > max_tokens
        refused = _job(s, width=width, height=height, num_frames=most + TINY.frame_stride)
        assert isinstance(refused, list) and "max_job_tokens" in refused[0]["msg"]
    steps = min(s.max_num_inference_steps, max_work // num_tokens)
    spec = _job(s, width=width, height=height, num_frames=most, num_inference_steps=steps,
                seed=7)
    assert isinstance(spec, JobSpec)
    state = tiny_pipeline.prepare(VideoRequest.of(spec))
    _, _, f, h, w = state.latents.shape
    p = TinyConfig().patch_size
    assert f * (h // p) * (w // p) == num_tokens
    assert state.num_inference_steps == spec.num_inference_steps


def _wan_dir(path: Path, vae: dict[str, Any]) -> str:
    path.mkdir()
    (path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    for component, config in (("vae", vae), ("transformer", {"patch_size": [1, 2, 2]})):
        (path / component).mkdir()
        (path / component / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_checkpoint_whose_vae_compresses_more_is_held_to_its_own_multiple(
        tmp_path: Path) -> None:
    # Wan2.2 TI2V-5B: a VAE of 16 in space and a patch of 2, so sizes are multiples of 32.
    ti2v = _wan_dir(tmp_path / "ti2v", {"scale_factor_spatial": 16, "scale_factor_temporal": 4})
    wan21 = _wan_dir(tmp_path / "wan21", {})
    s = _settings(models=[ti2v, wan21], max_job_tokens=10**6, max_job_work=10**8)
    assert _job(s, model=ti2v, width=848, height=480, num_frames=81) == [
        {"field": "width", "msg": "must be a multiple of 32, got 848; nearest: 832 or 864"}]
    assert isinstance(_job(s, model=ti2v, width=832, height=480, num_frames=81), JobSpec)
    assert isinstance(_job(s, model=wan21, width=848, height=480, num_frames=81), JobSpec)


def test_a_bare_request_gets_defaults_its_model_accepts(tmp_path: Path) -> None:
    models = ["kiln-tiny"]
    for class_name, index in (("WanPipeline", "model_index.json"),
                              ("CogVideoXPipeline", "model_index.json"),
                              ("Cosmos3OmniPipeline", "model_index.json"),
                              ("MiniMaxH3ModularPipeline", "modular_model_index.json")):
        (tmp_path / class_name).mkdir()
        (tmp_path / class_name / index).write_text(json.dumps({"_class_name": class_name}))
        models.append(str(tmp_path / class_name))
    # Wan's and CogVideoX's own sizes are larger than a CPU's default bound (32,760 and 17,550
    # tokens), which a deployment serving them raises.
    s = _settings(models=models, max_job_tokens=10**6, max_job_work=10**8)
    for model in models:
        spec = spec_from_job_create(JobCreate(prompt="a red circle", model=model), s, utcnow())
        assert spec.model == model


def _minimax_dir(path: Path) -> str:
    path.mkdir()
    (path / "modular_model_index.json").write_text(
        json.dumps({"_class_name": "MiniMaxH3ModularPipeline"}))
    return str(path)


def test_minimax_h3_is_held_to_its_own_clip_rule_from_5_to_15_seconds(tmp_path: Path) -> None:
    # Its VAE encodes clips of 17 frames into 5 latents plus two: 5 + 17k frames, 5 s to 15 s at
    # 24 fps (124 to 345); the deployment's 1 + 4k stride does not compose with that rule.
    model = _minimax_dir(tmp_path / "minimax")
    s = _settings(models=[model], max_job_tokens=10**6, max_job_work=10**8,
                  max_num_frames=400)
    assert isinstance(_job(s, model=model, width=1344, height=768, num_frames=124), JobSpec)
    assert isinstance(_job(s, model=model, width=1344, height=768, num_frames=345), JobSpec)
    message = "must be 5 + a multiple of 17 frames from 124 to 345 (124, 141, 158, ...), got "
    assert _job(s, model=model, width=1344, height=768, num_frames=125) == [
        {"field": "num_frames", "msg": message + "125; nearest: 124 or 141"}]
    assert _job(s, model=model, width=1344, height=768, num_frames=107) == [
        {"field": "num_frames", "msg": message + "107; nearest: 124"}]
    assert _job(s, model=model, width=1344, height=768, num_frames=362) == [
        {"field": "num_frames", "msg": message + "362; nearest: 345"}]
    assert _job(s, model=model, width=1360, height=768, num_frames=124) == [
        {"field": "width", "msg": "must be a multiple of 32, got 1360; nearest: 1344 or 1376"}]
    # Seconds at its 24 fps: 5 s is 124 frames, 10 s is 243.
    for seconds, frames in (("5", 124), ("10", 243)):
        spec = _video(s, model=model, size="1344x768", seconds=seconds, fps=24)
        assert isinstance(spec, JobSpec) and spec.num_frames == frames, spec


def test_a_quality_tier_is_held_to_what_the_model_measured() -> None:
    s = _settings(models=["kiln-tiny", "kiln-big"])
    fast = _job(s, quality="fast")
    assert isinstance(fast, JobSpec) and fast.quality == "fast"
    assert _job(s, quality="exact").quality is None  # exact is the default, stored as none
    refused = _job(s, model="kiln-big", quality="balanced")
    assert refused == [{"field": "quality", "msg": "generic renders at quality exact only (no "
                        "measured step cache thresholds), not balanced"}]
    with pytest.raises(ValidationError):  # the schema's 422 names the three tiers
        JobCreate(**OK_BODY, quality="fastest")


def test_a_strength_is_refused_for_a_family_that_keeps_a_clips_frames() -> None:
    """Cosmos3 keeps a clip's frames as they are and renders the rest: a strength is refused at
    the door, as its pipeline would refuse it; Wan renders a clip video-to-video and takes it."""
    from common.admission import input_problems
    from common.families import COSMOS3, WAN

    (problem,) = input_problems(COSMOS3, "video", strength=0.5)
    assert problem.field == "strength" and "takes no strength" in problem.message
    assert input_problems(COSMOS3, "video") == []
    assert input_problems(WAN, "video", strength=0.5) == []

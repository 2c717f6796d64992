"""A request that leaves fields out gets its model's own defaults, or the settings' override."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from api.jobs import request_defaults, spec_from_job_create
from api.schemas import JobCreate, VideoCreate
from common.families import GENERIC, TINY, WAN
from common.render import RenderFields
from common.settings import Settings
from storage.tables import utcnow


def _model_dir(tmp_path: Path, class_name: str) -> str:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return str(tmp_path)


def test_each_model_gets_what_it_was_made_for(tmp_path: Path) -> None:
    wan = _model_dir(tmp_path, "WanPipeline")
    s = Settings(models=["kiln-tiny", wan])
    assert request_defaults(s, "kiln-tiny") == TINY.defaults
    assert request_defaults(s, wan) == WAN.defaults
    # A model this API does not serve is never looked up on disk.
    assert request_defaults(Settings(), wan) == GENERIC.defaults


def test_a_default_setting_wins_for_every_model() -> None:
    s = Settings(default_num_inference_steps=12, default_fps=24)
    d = request_defaults(s, "kiln-tiny")
    assert (d.num_inference_steps, d.fps, d.width, d.num_frames) == (12, 24, 64, 9)


def test_a_bare_prompt_becomes_a_kiln_tiny_job_of_its_native_shape() -> None:
    spec = spec_from_job_create(JobCreate(prompt="a red circle moving left"), Settings(),
                                utcnow())
    assert (spec.width, spec.height, spec.num_frames, spec.num_inference_steps, spec.fps) == (
        64, 64, 9, 4, 8)


def test_the_request_bodies_take_the_render_fields_under_their_names() -> None:
    names = {f.name for f in dataclasses.fields(RenderFields)}
    assert names <= set(JobCreate.model_fields)
    # The OpenAI body gives size and length as ``size`` and ``seconds``.
    assert names - set(VideoCreate.model_fields) == {"width", "height", "num_frames"}

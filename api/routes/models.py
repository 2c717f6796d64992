"""``GET /v1/models``: the models this deployment serves, each with the values a request gets
for the fields it leaves out and the rules its sizes and lengths are held to (what the
dashboard's submit form fills in and checks; also the OpenAI SDK's ``models.list``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api import jobs
from api.deps import CurrentUser, SettingsDep
from common import admission

router = APIRouter(tags=["models"])


class ModelPublic(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "kiln"
    family: str
    defaults: dict[str, Any] = Field(description="what a request gets for a field it leaves out")
    size_multiple: int = Field(description="width and height are multiples of this")
    frame_stride: int = Field(description="a clip has frame_base + k x frame_stride frames")
    frame_base: int = Field(description="a clip has frame_base + k x frame_stride frames")
    min_num_frames: int
    min_size: int
    max_width: int
    max_height: int
    max_num_frames: int
    max_num_inference_steps: int
    max_prompt_chars: int
    inputs: list[str] = Field(description="the kinds of input file (image, video) a render may "
                                          "start from")
    needs_input: bool = Field(description="every render starts from one of those inputs")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelPublic]


@router.get("/v1/models", response_model=ModelList)
def list_models(user: CurrentUser, settings: SettingsDep) -> ModelList:
    """The served models, the default (``KILN_MODELS``' first) first."""
    data = []
    for model in settings.models:
        family = admission.family_for(settings, model)
        data.append(ModelPublic(
            id=model, family=family.name,
            defaults=dataclasses.asdict(jobs.request_defaults(settings, model)),
            size_multiple=admission.size_multiple(settings, family),
            frame_stride=admission.frame_stride(settings, family), frame_base=family.frame_base,
            min_num_frames=admission.frame_bounds(settings, family)[0],
            min_size=settings.min_size, max_width=settings.max_width,
            max_height=settings.max_height,
            max_num_frames=admission.frame_bounds(settings, family)[1],
            max_num_inference_steps=settings.max_num_inference_steps,
            max_prompt_chars=settings.max_prompt_chars,
            inputs=sorted(family.inputs), needs_input=family.needs_input))
    return ModelList(data=data)

"""The render fields: what one video's render needs, declared once.

`RequestDefaults` holds the fields a model has its own values for (``common.families``: each
family's size, length, frame rate, steps and guidance); `RenderFields` adds the prompts and the
seed. The job spec (``storage.submission.JobSpec``), the pipelines' request
(``runtime.pipelines.base.VideoRequest``, which a worker rank's ticket carries) and the API's
request bodies (``api.schemas``) are these fields under these names; so are the job table's
columns.

The step count is ``num_inference_steps`` from the request to the progress report.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True, slots=True)
class RequestDefaults:
    """The render fields a request may leave out: each model has its own values for them."""

    width: int  # pixels
    height: int
    num_frames: int
    fps: int  # frames per second of the written video
    num_inference_steps: int  # denoising steps
    guidance_scale: float  # classifier-free guidance scale


@dataclass(kw_only=True, frozen=True, slots=True)
class RenderFields(RequestDefaults):
    """Everything one video's render needs."""

    prompt: str
    negative_prompt: str | None = None  # None: no negative prompt
    # None: not chosen by the request; the job's row draws one, so that every attempt of the job
    # renders the same video.
    seed: int | None = None

"""Admission: whether a render request can run, decided once for every door.

The API (`api.jobs`: native jobs, OpenAI videos, batch lines), `kiln render` and the pipelines
all hold a request to these rules, so what one accepts the others render, and a refusal reads
the same wherever it happens. A rule gives a `Problem`: the field it is about, what is wrong,
and, where there is one, the nearest valid value. Nothing here loads a model or imports torch:
the CLI refuses a bad request before it loads anything.

Two sets of rules:

- the **model's own** (`model_problems`): sizes in its multiple, a clip of ``frame_base`` + k x
  ``frame_stride`` frames within its fewest and most, the inputs its pipeline conditions on.
  A pipeline checks these again with the numbers the loaded model reports;
- the **deployment's** (`request_problems`, with a `Settings`): its bounds on size, length,
  frame rate, steps, guidance, prompt length and the work of one job, composed with the model's
  (a deployment's size multiple of 32 and Wan's 16 give 32).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import overload

from common.families import GENERIC, Family, checkpoint_family, tokens
from common.render import RenderFields
from common.settings import Settings

__all__ = ["Problem", "Refused", "a", "family_for", "frame_bounds", "frame_stride",
           "input_problems", "model_problems", "models_taking", "nearest", "raise_if_any",
           "request_problems", "size_multiple"]

#: How an input is fitted to the job's size (`storage.media.fit`).
FIT_MODES = ("crop", "pad", "stretch")


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason a request cannot run."""

    field: str | None  # the request's field; None: several at once (the job as a whole)
    message: str  # what is wrong, and what would do
    nearest: tuple[int, ...] = ()  # the valid values either side of the one given, if any

    def __str__(self) -> str:
        return self.message if self.field is None else f"{self.field}: {self.message}"


class Refused(ValueError):
    """A request that cannot run, with every reason."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(map(str, self.problems)))


def raise_if_any(problems: list[Problem]) -> None:
    if problems:
        raise Refused(problems)


def family_for(s: Settings, model: str) -> Family:
    """The family whose rules a request for ``model`` is held to: the checkpoint's own
    (`common.families.checkpoint_family`, what its pipeline checks when the job starts);
    `GENERIC` for a model this deployment does not serve, which is never looked up on disk."""
    return checkpoint_family(model) if model in s.models else GENERIC


def models_taking(s: Settings, kind: str) -> list[str]:
    """The models of this deployment whose family conditions a render on a ``kind`` input."""
    return [m for m in s.models if kind in family_for(s, m).inputs]


def size_multiple(s: Settings | None, family: Family) -> int:
    """Width and height are multiples of this: of the family's multiple and the deployment's."""
    return family.size_multiple if s is None else math.lcm(family.size_multiple, s.size_multiple)


def frame_stride(s: Settings | None, family: Family) -> int:
    """A clip has ``family.frame_base`` + k x this many frames: for the causal VAEs (1 + k x
    their stride) the family's stride and the deployment's together; a family with a rule of
    its own (MiniMax-H3's 5 + 17k) keeps its own, which no deployment stride composes with."""
    if s is None or family.frame_base != 1:
        return family.frame_stride
    return math.lcm(family.frame_stride, s.frame_stride)


@overload
def frame_bounds(s: Settings, family: Family) -> tuple[int, int]: ...
@overload
def frame_bounds(s: None, family: Family) -> tuple[int, int | None]: ...
def frame_bounds(s: Settings | None, family: Family) -> tuple[int, int | None]:
    """The fewest and the most frames a clip of ``family`` may have (most None: no bound)."""
    if s is None:
        return family.min_frames, family.max_frames
    return family.min_frames, min(s.max_num_frames, family.max_frames or s.max_num_frames)


def nearest(value: int, step: int, low: int, high: int | None, base: int = 0) -> tuple[int, ...]:
    """The valid values (``base`` + k x ``step`` within [low, high]) either side of ``value``."""
    below = base + (value - base) // step * step
    near = [below, below + step]
    if high is not None and value > high:  # past the range: its last valid value
        near = [base + (high - base) // step * step]
    elif value < low:  # short of it: its first
        near = [low + (base - low) % step]
    return tuple(v for v in near if low <= v and (high is None or v <= high))


def _nearest_clause(values: tuple[int, ...]) -> str:
    return f"; nearest: {' or '.join(map(str, values))}" if values else ""


def _size_problems(problems: list[Problem], s: Settings | None, family: Family, width: int,
                   height: int, size_fields: tuple[str, str]) -> bool:
    multiple = size_multiple(s, family)
    low = s.min_size if s is not None else multiple
    ok = True
    max_width = s.max_width if s is not None else None
    max_height = s.max_height if s is not None else None
    for field, name, value, bound in ((size_fields[0], "width", width, max_width),
                                      (size_fields[1], "height", height, max_height)):
        which = "" if field == name else f"{name} "  # the OpenAI body's one ``size`` field
        if value < low or (bound is not None and value > bound):
            within = f"between {low} and {bound}" if bound is not None else f"at least {low}"
            problems.append(Problem(field, f"{which}must be {within}, got {value}"))
            ok = False
        elif value % multiple:
            near = nearest(value, multiple, low, bound)
            problems.append(Problem(field, f"{which}must be a multiple of {multiple}, got "
                                           f"{value}{_nearest_clause(near)}", near))
            ok = False
    return ok


def _frame_problems(problems: list[Problem], s: Settings | None, family: Family,
                    r: RenderFields, frames_field: str) -> bool:
    stride, base = frame_stride(s, family), family.frame_base
    fewest, most = frame_bounds(s, family)
    seconds = frames_field == "seconds"  # the OpenAI body gives the length in seconds
    if s is not None and r.num_frames > s.max_num_frames:
        if seconds:
            longest = (s.max_num_frames - 1) // stride * stride // r.fps
            problems.append(Problem(frames_field, f"at most {longest} s at {r.fps} fps "
                                    f"({s.max_num_frames} frames), got {r.num_frames} frames; "
                                    "use fewer seconds or a lower fps"))
        else:
            problems.append(Problem(frames_field,
                                    f"at most {s.max_num_frames} frames, got {r.num_frames}"))
        return False
    if (r.num_frames - base) % stride or r.num_frames < fewest or (
            most is not None and r.num_frames > most):
        first = fewest + (base - fewest) % stride  # the fewest that keeps the rule
        within = ""
        if most is not None and (fewest > 1 or s is None or most < s.max_num_frames):
            last = most - (most - base) % stride  # and the most
            within = f" from {first} to {last}"
        near = nearest(r.num_frames, stride, fewest, most, base=base)
        problems.append(Problem(frames_field, f"must be {base} + a multiple of {stride} frames"
                                f"{within} ({first}, {first + stride}, {first + 2 * stride}, "
                                f"...), got {r.num_frames}{_nearest_clause(near)}", near))
        return False
    return True


def _most_frames(r: RenderFields, family: Family, stride: int, max_tokens: int) -> int | None:
    """The most frames (base + k x ``stride``, from the family's fewest to the request's) that
    keep ``r``'s size within ``max_tokens``; None when the fewest are already too many."""
    base = family.frame_base
    for k in range((r.num_frames - base) // stride, -1, -1):
        n = base + k * stride
        if n < family.min_frames:
            break
        if tokens(r.width, r.height, n, family=family) <= max_tokens:
            return n
    return None


def _work_problems(problems: list[Problem], s: Settings, family: Family, r: RenderFields,
                   seconds: bool) -> None:
    """The largest job the deployment accepts (``max_job_tokens`` per step, ``max_job_work``
    in tokens x steps), in video tokens per transformer forward (`common.families.tokens`)."""
    stride = frame_stride(s, family)
    num_tokens = tokens(r.width, r.height, r.num_frames, family=family)
    shape = f"{r.width}x{r.height}, {r.num_frames} frames"
    max_tokens = s.max_job_tokens or family.max_tokens
    max_work = s.max_job_work or 50 * max_tokens
    if num_tokens > max_tokens:
        fit = _most_frames(r, family, stride, max_tokens)
        at = f"at {r.width}x{r.height}"
        if fit is not None and seconds and (fit - 1) // r.fps >= 1:
            how = f"fewer seconds (at most {(fit - 1) // r.fps} {at}) or a smaller size"
        elif fit is not None and not seconds:
            how = f"fewer frames (at most {fit} {at}) or a smaller size"
        else:
            how = "a smaller size"
        problems.append(Problem(None, f"the job is too large: {shape} is {num_tokens:,} video "
                                      f"tokens per step, over this deployment's max_job_tokens "
                                      f"of {max_tokens:,}; use {how}"))
        return
    work = num_tokens * r.num_inference_steps
    if work > max_work:
        steps = max_work // num_tokens
        fewer = f"fewer steps (at most {steps} at {shape}), " if steps else ""
        problems.append(Problem(None, f"the job is too large: {shape} is {num_tokens:,} video "
                                      f"tokens x {r.num_inference_steps} steps = {work:,}, over "
                                      f"this deployment's max_job_work of {max_work:,}; use "
                                      f"{fewer}a smaller size or fewer "
                                      f"{'seconds' if seconds else 'frames'}"))


def model_problems(family: Family, r: RenderFields) -> list[Problem]:
    """What the model itself cannot render: its size multiple and its frame rule (`kiln render`
    and the pipelines; a deployment adds its own bounds with `request_problems`)."""
    problems: list[Problem] = []
    _size_problems(problems, None, family, r.width, r.height, ("width", "height"))
    _frame_problems(problems, None, family, r, "num_frames")
    if r.num_inference_steps < 1:
        problems.append(Problem("num_inference_steps",
                                f"must be at least 1, got {r.num_inference_steps}"))
    return problems


def request_problems(s: Settings, r: RenderFields, *, model: str,
                     size_fields: tuple[str, str] = ("width", "height"),
                     frames_field: str = "num_frames") -> list[Problem]:
    """Everything about ``r`` that this deployment refuses for ``model``: the model's rules and
    the deployment's bounds at once, so that what is accepted is what the model's pipeline
    renders. ``size_fields`` and ``frames_field`` name the fields as the request gave them (the
    OpenAI body: one ``size``, and ``seconds``)."""
    problems: list[Problem] = []
    if model not in s.models:
        problems.append(Problem("model",
                                f"unknown model {model!r}; available: {', '.join(s.models)}"))
    family = family_for(s, model)
    shape_ok = _size_problems(problems, s, family, r.width, r.height, size_fields)
    shape_ok = _frame_problems(problems, s, family, r, frames_field) and shape_ok
    if shape_ok:
        _work_problems(problems, s, family, r, frames_field == "seconds")
    if r.fps > s.max_fps:
        problems.append(Problem("fps", f"at most {s.max_fps}, got {r.fps}"))
    if r.num_inference_steps > s.max_num_inference_steps:
        problems.append(Problem("num_inference_steps", f"at most {s.max_num_inference_steps}, "
                                                       f"got {r.num_inference_steps}"))
    if r.guidance_scale > s.max_guidance_scale:
        problems.append(Problem("guidance_scale",
                                f"at most {s.max_guidance_scale}, got {r.guidance_scale}"))
    if len(r.prompt) > s.max_prompt_chars:
        problems.append(Problem("prompt", f"at most {s.max_prompt_chars} characters, got "
                                          f"{len(r.prompt)}"))
    if r.negative_prompt is not None and len(r.negative_prompt) > s.max_prompt_chars:
        problems.append(Problem("negative_prompt", f"at most {s.max_prompt_chars} characters"))
    if not r.prompt.strip():
        problems.append(Problem("prompt", "must not be blank"))
    return problems


def a(kind: str) -> str:
    """``kind`` with its article: "an image", "a video"."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def input_problems(family: Family, kind: str | None, *, field: str = "input_reference",
                   fit: str | None = None, strength: float | None = None,
                   able: Iterable[str] = ()) -> list[Problem]:
    """Whether ``family`` conditions a render on an input of ``kind`` ("image", "video"; None:
    no input). A family that needs one (it takes inputs but renders no text-only video) refuses
    a request without. ``able``: the models of the deployment that take such an input, named in
    the refusal."""
    problems: list[Problem] = []
    if kind is not None and kind not in family.inputs:
        models = list(able)
        hint = (f"models that take one: {', '.join(models)}" if models
                else "no model of this deployment takes one")
        problems.append(Problem(field, f"{family.name} cannot take {a(kind)} input; {hint}"))
    elif kind is None and family.needs_input:
        problems.append(Problem(field, f"{family.name} renders from an input: give "
                                       f"{' or '.join(map(a, sorted(family.inputs)))}"))
    if fit is not None and fit not in FIT_MODES:
        problems.append(Problem("fit", f"must be one of {', '.join(FIT_MODES)}, got {fit!r}"))
    if strength is not None:
        if kind != "video":
            problems.append(Problem("strength", "applies to a video input only"))
        elif not family.takes_strength:
            problems.append(Problem("strength", f"{family.name} keeps the clip's frames as they "
                                                "are and renders the rest: it takes no strength"))
        elif not 0.0 < strength <= 1.0:
            problems.append(Problem("strength", f"must be in (0, 1], got {strength}"))
    return problems

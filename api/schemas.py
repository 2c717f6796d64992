"""Request and response bodies of the HTTP API, apart from the ORM tables.

Static bounds here are sanity caps that hold whatever the deployment; the configurable limits in
`Settings` (max size, frames, steps, prompt length) are checked in `api.jobs` and reported the
same way, as a 422 that names the field.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    Strict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from storage.tables import MAX_PRIORITY, MAX_SEED, MIN_PRIORITY
from storage.webhooks import BatchWebhookEvent, WebhookEvent

HARD_MAX_TEXT = 100_000
HARD_MAX_DIM = 16_384


def _storable(value: str) -> str:
    # PostgreSQL text cannot hold NUL, and lone surrogates (legal in JSON escapes) cannot be
    # encoded: both would fail at INSERT time, so refuse them here with a reason.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("must be valid Unicode (no lone surrogates)") from exc
    return value


Text = Annotated[StrictStr, AfterValidator(_storable)]
MetaKey = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_storable)]
MetaValue = (
    Annotated[StrictStr, Field(max_length=1024), AfterValidator(_storable)]
    | StrictBool | StrictInt | Annotated[StrictFloat, Field(allow_inf_nan=False)] | None
)


def _utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError as exc:  # e.g. year 1 with a positive offset
        raise ValueError("is out of the representable range") from exc


UTCInstant = Annotated[AwareDatetime, AfterValidator(_utc)]
SafeQuery = r"^[^\x00]+$"  # query strings reach SQL; PostgreSQL text cannot hold NUL


def _small_metadata(value: dict[str, Any]) -> dict[str, Any]:
    if len(value) > 64:
        raise ValueError("at most 64 keys")
    return value


Metadata = Annotated[dict[MetaKey, MetaValue], AfterValidator(_small_metadata)]

# The render fields (`common.render.RenderFields`) as the request bodies take them, under their
# names there, each with its sanity cap: declared once for `JobCreate` (JSON numbers only:
# ``Strict``) and `VideoCreate` (which also takes a form's strings). Left out (None), a field
# gets its model's default.
PromptText = Annotated[Text, Field(min_length=1, max_length=HARD_MAX_TEXT)]
NegativePromptText = Annotated[Text, Field(max_length=HARD_MAX_TEXT)]
Dimension = Annotated[int, Field(ge=1, le=HARD_MAX_DIM)]  # width, height
NumFrames = Annotated[int, Field(ge=1, le=100_000)]
Fps = Annotated[int, Field(ge=1, le=1000)]
NumInferenceSteps = Annotated[int, Field(ge=1, le=100_000)]
GuidanceScale = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


# A job's adapters: at most this many, each with a scale in [-MAX_ADAPTER_SCALE, MAX_ADAPTER_SCALE].
MAX_JOB_ADAPTERS = 4
MAX_ADAPTER_SCALE = 4.0
# An adapter's name: what `kiln submit --adapter NAME[:SCALE]` gives (no colon).
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class JobAdapter(BaseModel):
    """One LoRA adapter a job applies, with its scale (1: as trained, 0: no effect)."""

    model_config = ConfigDict(extra="forbid")

    id: Annotated[Text, Field(min_length=1, max_length=64,
                              description="an adapter of yours or a shared one "
                                          "(GET /v1/adapters)")]
    scale: Annotated[float, Field(ge=-MAX_ADAPTER_SCALE, le=MAX_ADAPTER_SCALE,
                                  allow_inf_nan=False)] = 1.0


class JobCreate(BaseModel):
    """POST /v1/jobs. Omitted fields get the deployment's defaults."""

    model_config = ConfigDict(extra="forbid", populate_by_name=False)

    prompt: PromptText
    negative_prompt: NegativePromptText | None = None
    model: Annotated[Text, Field(min_length=1, max_length=100)] | None = None
    width: Annotated[Dimension, Strict()] | None = None
    height: Annotated[Dimension, Strict()] | None = None
    num_frames: Annotated[NumFrames, Strict()] | None = None
    fps: Annotated[Fps, Strict()] | None = None
    num_inference_steps: Annotated[NumInferenceSteps, Strict()] | None = None
    guidance_scale: GuidanceScale | None = None
    seed: Annotated[Seed, Strict()] | None = None
    priority: Annotated[StrictInt, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 5
    job_class: Literal["interactive", "batch"] = Field(default="interactive", alias="class")
    not_before: UTCInstant | None = None
    deadline: UTCInstant | None = None
    webhook_url: Annotated[HttpUrl, Field(
        max_length=2048,
        description="POSTed once the job ends (signed with KILN_WEBHOOK_SECRET). Outside a "
                    "local deployment (KILN_WEBHOOK_ALLOW_PRIVATE), loopback, private and "
                    "link-local addresses are refused: a 422 for such an IP, and no POST to "
                    "a name that resolves to one. A URL with a user name or password is "
                    "refused everywhere.")] | None = None
    webhook_events: Annotated[list[WebhookEvent], Field(
        max_length=16,
        description="the events POSTed to webhook_url: job.started, job.progress (at most "
                    "every 2 s), job.succeeded, job.failed, job.cancelled, job.dead, "
                    "job.expired. Left out: the final events only.")] | None = None
    metadata: Metadata = Field(default_factory=dict)
    input_file_id: Annotated[Text, Field(
        min_length=1, max_length=64,
        description="an upload of yours (POST /v1/files) to start from: an image to animate "
                    "or a video to restyle, for a model that takes one (GET /v1/models: "
                    "inputs)")] | None = None
    fit: Literal["crop", "pad", "stretch"] | None = Field(
        default=None, description="how the input is fitted to width x height: crop (the "
                                  "default: cover, then cut the middle), pad (fit inside, "
                                  "on black) or stretch")
    strength: Annotated[float, Field(
        gt=0, le=1, allow_inf_nan=False,
        description="video-to-video: how far the render moves from the input video (1: from "
                    "pure noise)")] | None = None
    audio: StrictBool | None = Field(
        default=None, description="write the soundtrack the model makes (left out: yes, "
                                  "where the model makes one)")
    adapters: Annotated[list[JobAdapter], Field(
        max_length=MAX_JOB_ADAPTERS,
        description="LoRA adapters to apply, each with its scale, in this order: registered "
                    "ones (POST /v1/adapters) for this model")] | None = None
    quality: Literal["exact", "balanced", "fast"] | None = Field(
        default=None, description="exact (the default) computes every block of every step; "
                                  "balanced and fast skip the rest of a step's blocks when its "
                                  "first block's output has hardly changed (a model that has "
                                  "measured thresholds only: kiln-tiny)")


class BatchWindow(BaseModel):
    """When a batch may run: set as ``not_before``/``deadline`` on every one of its jobs."""

    model_config = ConfigDict(extra="forbid")

    not_before: UTCInstant | None = None
    deadline: UTCInstant | None = None


class BatchCreate(BaseModel):
    """POST /v1/batches as JSON. Each job is a `JobCreate` body laid over ``defaults`` and is
    checked exactly like one; every job gets class ``batch``."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[Text, Field(max_length=200)] | None = None
    defaults: dict[str, Any] = Field(default_factory=dict,
                                     description="JobCreate fields shared by every job")
    jobs: list[dict[str, Any]] = Field(description="JobCreate bodies, one per job")
    window: BatchWindow | None = None
    metadata: Metadata = Field(default_factory=dict)
    webhook_url: Annotated[HttpUrl, Field(
        max_length=2048,
        description="POSTed batch.completed, with the batch's report, once its last job has "
                    "ended; signed and checked like a job's webhook_url (a job's own webhook "
                    "goes in its line or the defaults).")] | None = None
    webhook_events: Annotated[list[BatchWebhookEvent], Field(
        max_length=1, description="batch.completed, the one batch event. Left out: "
                                  "batch.completed; []: none")] | None = None


class VideoCreate(BaseModel):
    """POST /v1/videos in the OpenAI shape (form or JSON), plus optional kiln extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: PromptText
    model: Annotated[Text, Field(min_length=1, max_length=100)] | None = None
    # width, height and num_frames, the OpenAI way
    seconds: Annotated[str, Field(pattern=r"^[0-9]{1,4}$")] | None = None
    size: Annotated[str, Field(pattern=r"^[0-9]{1,5}x[0-9]{1,5}$")] | None = None
    # kiln extensions (the SDK's extra_body)
    negative_prompt: NegativePromptText | None = None
    fps: Fps | None = None
    num_inference_steps: NumInferenceSteps | None = None
    guidance_scale: GuidanceScale | None = None
    seed: Seed | None = None


class Progress(BaseModel):
    fraction: float = Field(description="0..1")
    step: int
    total: int


class JobError(BaseModel):
    code: str
    message: str


class JobPublic(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: str = Field(description="queued|running|succeeded|failed|cancelled|dead|expired")
    owner: str | None = None
    model: str
    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    job_class: str = Field(serialization_alias="class")
    priority: int
    not_before: datetime | None
    deadline: datetime | None
    webhook_url: str | None
    webhook_events: list[str] | None = Field(
        default=None, description="the webhook events asked for; null: the final ones")
    metadata: dict[str, Any]
    batch_id: str | None = Field(default=None, description="the batch it was submitted in")
    progress: float = Field(description="0..1; step / total")
    step: int
    total_steps: int
    queue_position: int | None = Field(
        description="queued jobs ahead of this one (0 = next); null unless queued")
    attempts: int
    max_attempts: int
    resumed_from_step: int | None = Field(
        description="the step the current (or last) attempt resumed from, a checkpoint of an "
                    "earlier attempt's denoising state; null: it started at step 0")
    preemptions: int = Field(
        description="how many times the job was suspended on its worker replica while an "
                    "interactive job ran there (it then continued where it stopped)")
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    render_seconds: float | None
    gathers: int | None = Field(
        default=None, description="block gathers the successful attempt's steps took part in "
                                  "(0 where the group gathers no weights); null until it "
                                  "succeeds")
    blocks_computed: int | None = Field(
        default=None, description="transformer blocks the successful attempt computed, where a "
                                  "step cache counts them (fewer than blocks x forwards when "
                                  "the quality tier skipped some); null otherwise")
    input_file_id: str | None = Field(
        default=None, description="the upload the render starts from (GET /v1/jobs/{id}/input "
                                  "serves it); null: text only, or the file was deleted")
    fit: Literal["crop", "pad", "stretch"] | None = Field(
        default=None, description="how the input is fitted to width x height; null without one")
    strength: float | None = Field(
        default=None, description="video-to-video: how far the render moves from the input "
                                  "video; null: the model's default")
    video_url: str | None
    thumbnail_url: str | None
    adapters: list[JobAdapter] | None = Field(
        default=None, description="the LoRA adapters it applies, with their scales")
    quality: str = Field(default="exact", description="exact, balanced or fast")
    has_audio: bool | None = Field(
        default=None, description="whether the video has a soundtrack (an AAC stream in the "
                                  "MP4); null until the video is written")
    error: JobError | None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobPublic]
    next_cursor: str | None
    has_more: bool


class BatchProgress(BaseModel):
    finished: int = Field(description="jobs in a final state")
    total: int
    fraction: float = Field(description="finished / total")
    step_fraction: float = Field(
        description="mean over jobs of the share of their steps done (a finished job: 1)")


class BatchPublic(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    owner: str | None = None
    name: str | None
    metadata: dict[str, Any]
    not_before: datetime | None
    deadline: datetime | None
    status: str = Field(description="queued (none started yet) | running | finished")
    counts: dict[str, int] = Field(description="jobs per state, every state listed")
    progress: BatchProgress
    eta: datetime | None = Field(
        description="when the last job should end at the pace so far; null until one ended")
    eta_seconds: float | None
    created_at: datetime
    started_at: datetime | None = Field(description="when its first job started")
    finished_at: datetime | None = Field(description="when its last job ended")
    jobs_url: str
    webhook_url: str | None = None
    webhook_events: list[str] | None = Field(
        default=None, description="the webhook events asked for; null: batch.completed")


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchPublic]
    next_cursor: str | None
    has_more: bool


class BatchCancelled(BaseModel):
    object: Literal["batch.cancel"] = "batch.cancel"
    cancelled: int = Field(description="queued jobs cancelled at once")
    cancel_requested: int = Field(description="running jobs that stop after their current step")
    batch: BatchPublic


class BatchReportJob(BaseModel):
    id: str
    line: int | None = Field(description="1-based line (or position) in the submission")
    status: str
    prompt: str
    seed: int
    started_at: datetime | None
    finished_at: datetime | None
    render_seconds: float | None
    video_url: str | None
    thumbnail_url: str | None
    error: JobError | None


class BatchReport(BaseModel):
    """The morning report of a batch."""

    id: str
    object: Literal["batch.report"] = "batch.report"
    name: str | None
    num_jobs: int
    counts: dict[str, int] = Field(description="jobs per state, every state listed")
    not_before: datetime | None
    deadline: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    active_seconds: float | None = Field(
        description="from the first job's start to the last finish of a job that ran")
    videos_per_hour: float | None = Field(
        description="succeeded jobs per hour of active_seconds; null until a job ran and ended")
    total_render_seconds: float = Field(description="summed render_seconds of its jobs")
    problems: list[BatchReportJob] = Field(description="the failed, expired and dead jobs")
    jobs: list[BatchReportJob]


class VideoError(BaseModel):
    code: str
    message: str


VideoStatus = Literal["queued", "in_progress", "completed", "failed"]


class VideoPublic(BaseModel):
    """The OpenAI ``Video`` object."""

    id: str
    object: Literal["video"] = "video"
    created_at: int
    completed_at: int | None
    expires_at: int | None = None
    model: str
    progress: int
    prompt: str
    remixed_from_video_id: str | None = None
    seconds: str
    size: str
    status: VideoStatus
    error: VideoError | None
    has_audio: bool | None = Field(
        default=None, description="whether the video has a soundtrack; null until it is "
                                  "written")


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoPublic]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


# An upload's purpose: the kind of input it must be. "vision" (an image) and "user_data" (either)
# are the OpenAI SDK's names for the same.
FilePurpose = Literal["image", "video", "vision", "user_data"]
PURPOSE_KINDS: dict[str, tuple[str, ...]] = {
    "image": ("image",), "vision": ("image",), "video": ("video",),
    "user_data": ("image", "video"),
}


class FilePublic(BaseModel):
    """An uploaded input file in the OpenAI ``File`` shape, with what kiln found in it."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds")
    expires_at: int | None = Field(description="Unix seconds when retention deletes it; null: "
                                               "kept")
    filename: str | None
    purpose: str
    status: Literal["processed"] = "processed"  # every stored file was decoded and checked
    kind: Literal["image", "video"]
    content_type: str = Field(description="from the content, not the upload's header")
    width: int = Field(description="after EXIF orientation")
    height: int
    num_frames: int = Field(description="1 for an image")
    duration_seconds: float | None = Field(description="null for an image")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FilePublic]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class AdapterPublic(BaseModel):
    """A registered LoRA adapter: checked against its model's transformer when it was
    registered, and usable by jobs for that model."""

    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    model: str
    family: str
    rank: int = Field(description="the largest rank of its layers")
    bytes: int
    sha256: str = Field(description="of the file's bytes")
    shared: bool = Field(description="registered by an admin for every user")
    created_at: int = Field(description="Unix seconds")


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterPublic]


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True


class RankPublic(BaseModel):
    rank: int
    replica: int | None = None  # the replica this rank renders with (rank // sp)
    device: str | None = None
    device_mem_used_bytes: int | None = None
    device_mem_total_bytes: int | None = None
    host_mem_bytes: int | None = None  # the rank process's proportional set size (PSS)
    cgroup_mem_bytes: int | None = None  # what the rank's memory cgroup is charged
    job_id: str | None = None  # only when the caller may see that job
    step: int | None = None  # the job's step, when the caller may see the job
    total_steps: int | None = None
    pid: int | None = None  # the rank's process on its host
    num_blocks: int | None = Field(default=None, description="streamed transformer blocks")
    resident_blocks: int | None = Field(
        default=None, description="of them, how many stay on the device")
    device_weight_buffer_bytes: int | None = Field(
        default=None, description="device bytes for block weights: the resident blocks and "
                                  "the two slots the others stream through")
    model_bytes: int | None = Field(
        default=None, description="the streamed transformers' whole size, unsharded")
    weights_dtype: str | None = Field(
        default=None, description="what the group keeps and moves its streamed blocks in: "
                                  "checkpoint (as the model has them), bf16 or fp8")
    stored_block_bytes: int | None = Field(
        default=None, description="the transformers' blocks as they are kept and moved (in "
                                  "weights_dtype), unsharded")
    step_gathers: int | None = Field(
        default=None, description="block gathers the rank's last step took part in (computing "
                                  "or not)")
    step_blocks_computed: int | None = Field(
        default=None, description="transformer blocks the rank's last step computed, where its "
                                  "pipeline has a step cache that counts them")
    adapter_bytes: int | None = Field(
        default=None, description="LoRA adapters loaded on the rank (their factors and device "
                                  "copies)")
    adapter_budget_bytes: int | None = Field(
        default=None, description="the most its adapter cache keeps (KILN_ADAPTER_CACHE_BYTES)")


class ReplicaPublic(BaseModel):
    replica: int
    ranks: list[int]  # the first one decodes and stores the replica's videos
    job_id: str | None = None  # only when the caller may see that job


class WorkerGroupPublic(BaseModel):
    id: str
    name: str
    host: str
    model: str
    mode: str
    platform: str
    dp_size: int = Field(description="replicas: jobs the group renders at once")
    sp_size: int = Field(description="ranks per replica, splitting one job's token sequence")
    goal: str | None = Field(
        default=None, description="latency (takes interactive jobs first) | throughput (batch "
                                  "jobs first); either takes the other class when its own is "
                                  "not queued. Null for a group that reported none")
    plan: dict[str, Any] | None = Field(
        default=None, description="kiln worker --layout auto: the layout chosen and the "
                                  "runner-up, with their predicted figures; null when the "
                                  "layout was given")
    world_size: int
    replicas: list[ReplicaPublic]
    state: str = Field(description="starting | ready | degraded | stopping | stopped")
    reason: str | None = Field(default=None, description="why, when degraded")
    stale: bool
    started_at: datetime
    heartbeat_at: datetime
    ranks: list[RankPublic]
    host_mem_bytes: int | None = Field(
        default=None, description="the ranks' PSS summed: the group's own share of host "
                                  "memory, the shared weight mapping counted once")
    num_running: int
    current_jobs: list[str]


class WorkerGroupList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WorkerGroupPublic]


def metadata_bytes(value: dict[str, Any]) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())

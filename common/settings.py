"""One validated configuration object for every kiln process (API, workers, CLI).

Values come from the environment (prefix ``KILN_``; ``DATABASE_URL`` and ``REDIS_URL`` are also
accepted unprefixed because every hosting platform sets those) or a ``.env`` file. The defaults run
on a laptop: a SQLite file and an output directory under ``./var``. Only the environment does not
default to the laptop's (``local``): `kiln up` sets it for its children.

Secrets (the S3 secret key, the deployment's webhook secret, the metrics token) are `SecretStr`: a
repr, a log line or a traceback of the settings shows ``**********``, and code that uses one asks
for it by name (``.get_secret_value()``). The database and Redis URLs stay plain strings for the
libraries that take them; kiln prints them with the password hidden.
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.retry import ceiling

# Values copied from an example file that must never reach a shared deployment.
PLACEHOLDER_SECRETS = frozenset({"changethis", "changeme", "password", "secret", "example"})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KILN_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    # "local" (what `kiln up` sets for its children: a developer's machine) only warns about
    # placeholder secrets and lets webhooks reach private addresses; anything else refuses to
    # start with placeholders and keeps webhooks on public addresses. A deployment that forgets
    # to say gets the guarded behaviour.
    environment: Literal["local", "staging", "production"] = "production"

    database_url: str = Field(
        default="sqlite:///./var/kiln.db",
        validation_alias=AliasChoices("KILN_DATABASE_URL", "DATABASE_URL"),
    )
    # None: `kiln up` starts a private Redis server and fills this in for its children.
    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("KILN_REDIS_URL", "REDIS_URL")
    )
    # Every key kiln writes in Redis starts with this, so one Redis can serve several deployments
    # (and tests can clean up exactly their own keys).
    redis_prefix: str = "kiln:"

    # Every process's log lines (common.logs): text (timestamp, level, logger, rank, job,
    # attempt, message) or json (one object a line, for a log shipper), at this level and up.
    # `kiln --log-format/--log-level` set them for the command and every process it starts.
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # The deployment's own state files: Celery beat's schedule; under `kiln up`, its private
    # Redis, the admin key and logs/ (one file per child).
    data_dir: Path = Path("./var")
    # Output store: a local directory unless storage_url is given (s3://bucket/optional/prefix).
    output_dir: Path = Path("./var/outputs")
    storage_url: str | None = None
    s3_endpoint_url: str | None = None  # for S3-compatible servers (MinIO, Ceph, R2, ...)
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: SecretStr | None = None
    # Presigned download links for S3 outputs live this long.
    url_expires_seconds: int = Field(default=3600, ge=1)

    # How long the API trusts a key it has already checked (a revoked key works this long).
    api_key_cache_seconds: float = Field(default=10.0, ge=0)
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    # The Retry-After of a 503 the API answers while the database or Redis is unreachable.
    unavailable_retry_after_seconds: int = Field(default=5, ge=1)
    # GET /v1/events: how often a stream looks for news (one short read each time, no connection
    # held in between) and how often an idle stream sends a keep-alive comment.
    events_poll_seconds: float = Field(default=0.5, gt=0)
    events_heartbeat_seconds: float = Field(default=15.0, gt=0)
    # At shutdown, requests still open after this long are cut off; without it an open event
    # stream (a status page left open) would keep the API from stopping.
    api_shutdown_grace_seconds: float = Field(default=5.0, ge=0)
    # GET /metrics answers only `Authorization: Bearer <this>` when set (Prometheus'
    # `authorization` scrape setting); unset, it is open, as on a laptop.
    metrics_token: SecretStr | None = None

    # Models a job may name; the first is used when a request names none.
    models: list[str] = Field(default_factory=lambda: ["kiln-tiny"], min_length=1)

    # What a request that leaves these out gets. None (the default): the model's own, what it was
    # trained for (common.families: kiln-tiny 64x64, 9 frames, 4 steps; Wan 832x480, 81 frames, 50
    # steps); a value set here applies to every model.
    default_width: int | None = Field(default=None, ge=8)
    default_height: int | None = Field(default=None, ge=8)
    default_num_frames: int | None = Field(default=None, ge=1)
    default_num_inference_steps: int | None = Field(default=None, ge=1)
    default_guidance_scale: float | None = Field(default=None, ge=0)

    # Request bounds: every job-creating request is checked against these before it is stored.
    min_size: int = Field(default=16, ge=8)
    max_width: int = Field(default=1920, ge=16)
    max_height: int = Field(default=1920, ge=16)
    # Latent patching needs sizes divisible by this. Each model is also held to its family's own
    # multiple (common.families: 16 for kiln-tiny, Wan and CogVideoX): a request must meet both.
    size_multiple: int = Field(default=8, ge=1)
    # Video VAEs compress time by this factor after the first frame (Wan, kiln-tiny: 4), so a
    # video has 1 + k * frame_stride frames; the family's own stride applies too.
    frame_stride: int = Field(default=4, ge=1)
    max_num_frames: int = Field(default=257, ge=1)
    max_fps: int = Field(default=60, ge=1)
    default_fps: int | None = Field(default=None, ge=1)
    max_num_inference_steps: int = Field(default=200, ge=1)
    # The largest job accepted, in video tokens per step (what one transformer forward sees,
    # common.families.tokens; a step's time grows faster than its tokens, attention being
    # quadratic) and in tokens x steps. Unset: each model family's own bound
    # (common.families.Family.max_tokens, and that step 50 times), which for kiln-tiny, the
    # family that renders on CPUs, keeps a step well under lease_seconds. Measured for
    # kiln-tiny on a 2-core AMD EPYC, one torch thread (one rank of `--dp 2`), CFG on: 0.70 s
    # per step at 3,072 tokens (512x512, 9 frames; 2.3e-4 s per token), 9.0 s at 12,288
    # (1024x1024, 9 frames; 7.3e-4 s per token), 20 s at 16,384 (1024x1024, 13 frames), so
    # 16,384 keeps the largest step near a sixth of the default 120 s lease. The work bound is
    # that step 50 times (the step count Wan and CogVideoX default to): about 17 minutes on that
    # CPU. Wan's and CogVideoX's bounds are their largest released sizes.
    max_job_tokens: int | None = Field(default=None, ge=1)
    max_job_work: int | None = Field(default=None, ge=1)
    max_guidance_scale: float = Field(default=50.0, gt=0)
    max_prompt_chars: int = Field(default=4000, ge=1)
    max_metadata_bytes: int = Field(default=4096, ge=2)
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    # POST /v1/batches carries a whole prompt list (JSON or JSONL), so it gets its own limit.
    max_batch_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # Input files (POST /v1/files, /v1/videos' input_reference): refused over this many bytes
    # (413) as the upload streams in, before it is decoded; counted on the file, not the form.
    max_upload_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Every input is decoded and checked before anything keeps it (storage.media). Pixels of an
    # image or of a video's frame, read from the header before any pixel is decoded: a 48-MP
    # phone photo (8000x6000) fits, and decodes to 144 MB of RGB. At most Pillow's own
    # decompression-bomb bound (PIL.Image.MAX_IMAGE_PIXELS), which kiln does not raise.
    max_input_pixels: int = Field(default=48_000_000, ge=64, le=89_478_485)
    # A video's frames and seconds, checked from the container's header and again while every
    # frame is decoded (a header can lie): 30 s at 30 fps.
    max_input_frames: int = Field(default=900, ge=1)
    max_input_seconds: float = Field(default=30.0, gt=0)
    max_schedule_days: int = Field(default=30, ge=1)  # how far ahead not_before/deadline may be
    # Queued jobs a user may hold at once; beyond it submits get 429 with Retry-After. Room for
    # an overnight batch of thousands of prompts; a batch larger than this is refused whole.
    max_queued_jobs_per_user: int = Field(default=10_000, ge=1)
    queue_full_retry_after_seconds: int = Field(default=30, ge=1)

    # Worker leases: a running job whose lease is not renewed within this is given back to the
    # queue (or marked dead after max_attempts attempts).
    lease_seconds: int = Field(default=120, ge=5)
    max_attempts: int = Field(default=3, ge=1)
    # While a job runs, its replica's leader stores a preview frame (the current estimate of the
    # clip's middle frame) every this many steps, at most twice a second, for the job page: only
    # where the model's pipeline offers it cheaply (kiln-tiny: under a tenth of a step). 0: none.
    preview_every_steps: int = Field(default=2, ge=0)
    # A running job's denoising state (latents, scheduler state, RNG) is checkpointed into the
    # output store every this many steps or seconds, whichever comes first (0: not by that
    # measure), and whenever the job is handed back, so a job that moves (a drain, a crashed
    # rank, a restart) resumes where it was, bit for bit. Both 0: no checkpoints.
    checkpoint_every_steps: int = Field(default=5, ge=0)
    checkpoint_every_seconds: float = Field(default=60.0, ge=0)
    # Each rank keeps the LoRA adapters of the jobs it took loaded (their factors on its device)
    # in an LRU cache of at most this many bytes (`runtime.adapter_cache`); an adapter larger
    # than this fails the job that names it.
    adapter_cache_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)
    # How often the API re-adds queued jobs from the database to the Redis queue index.
    reconcile_interval_seconds: float = Field(default=60.0, gt=0)
    # A worker group that has not reported for this long is shown as stale.
    worker_stale_seconds: int = Field(default=60, ge=1)

    # Side work (kiln.tasks, run by `kiln celery`). How often beat runs the lease reaper; the
    # queue-index reconciliation runs every reconcile_interval_seconds.
    reaper_interval_seconds: float = Field(default=15.0, gt=0)
    # Webhooks: every delivery is signed (Standard Webhooks' webhook-signature) with its owner's
    # own secret (storage.webhook_secrets), made on first need. After a rotation the replaced
    # secret signs too, for this long.
    webhook_secret_overlap_hours: float = Field(default=24.0, ge=0)
    # A deployment-wide secret that, when set, adds one more signature to every delivery: for
    # receivers set up with it before users had secrets of their own. Any user can cause a
    # delivery signed with it, so a receiver that verifies with it cannot tell one user's events
    # from another's; unset it once receivers verify with their owner's secret.
    webhook_secret: SecretStr | None = None
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    # Attempts per delivery; retries wait webhook_backoff_seconds, doubling up to the maximum.
    webhook_max_attempts: int = Field(default=8, ge=1)
    webhook_backoff_seconds: float = Field(default=10.0, gt=0)
    webhook_backoff_max_seconds: float = Field(default=600.0, gt=0)
    # Whether a webhook_url may point at loopback, private (RFC 1918, ULA), link-local (cloud
    # metadata), multicast or reserved addresses. Users choose the URL and the POST comes from
    # inside the deployment, so allowing this lets them reach internal services. None: allowed
    # only when environment is "local" (a receiver on the developer's machine); see common.netguard.
    webhook_allow_private: bool | None = None
    # The sweeper sends every webhook retry once due, and re-sends deliveries whose task was lost,
    # for jobs finished within webhook_sweep_hours (a job's retries must end within it). A retry
    # goes out between its time and one interval later (plus the queue's wait): keep the
    # interval at most half of webhook_backoff_seconds, the spread of the backoff's own jitter.
    webhook_sweep_interval_seconds: float = Field(default=5.0, gt=0)
    webhook_sweep_hours: float = Field(default=24.0, gt=0)
    # Outputs of jobs finished longer ago than this are deleted (the rows stay); 0 keeps them.
    retention_days: int = Field(default=30, ge=0)
    retention_interval_seconds: float = Field(default=3600.0, gt=0)
    # Celery on Redis re-delivers a task not acknowledged within this; it must exceed the longest
    # task run, or a task runs twice.
    celery_visibility_timeout_seconds: int = Field(default=6 * 3600, ge=60)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.min_size > min(self.max_width, self.max_height):
            raise ValueError("min_size exceeds max_width or max_height")
        for name, low, high in (("fps", 1, self.max_fps),
                                ("width", self.min_size, self.max_width),
                                ("height", self.min_size, self.max_height),
                                ("num_frames", 1, self.max_num_frames),
                                ("num_inference_steps", 1, self.max_num_inference_steps)):
            value = getattr(self, f"default_{name}")
            if value is not None and not low <= value <= high:
                raise ValueError(f"default_{name} ({value}) is outside [{low}, {high}]")
        if self.storage_url is not None and urlsplit(self.storage_url).scheme != "s3":
            raise ValueError(f"storage_url must be s3://bucket[/prefix], got {self.storage_url!r}")
        retries = sum(ceiling(n, first=self.webhook_backoff_seconds,
                              cap=self.webhook_backoff_max_seconds)
                      for n in range(1, self.webhook_max_attempts))
        if retries >= self.webhook_sweep_hours * 3600:
            raise ValueError(f"webhook_max_attempts with its backoff waits up to {retries:.0f} s, "
                             "beyond webhook_sweep_hours: the sweeper would stop retrying first")
        self._check_secret("s3_secret_access_key", _plain(self.s3_secret_access_key))
        self._check_secret("webhook_secret", _plain(self.webhook_secret))
        self._check_secret("metrics_token", _plain(self.metrics_token))
        self._check_secret("database_url password", urlsplit(self.database_url).password)
        if self.redis_url is not None:
            self._check_secret("redis_url password", urlsplit(self.redis_url).password)
        return self

    def _check_secret(self, name: str, value: str | None) -> None:
        if value is None or value.lower() not in PLACEHOLDER_SECRETS:
            return
        message = f"{name} is the placeholder {value!r}; set a real secret"
        if self.environment == "local":
            warnings.warn(message, stacklevel=2)
        else:
            raise ValueError(message)

    @property
    def default_model(self) -> str:
        return self.models[0]


def _plain(secret: SecretStr | None) -> str | None:
    return None if secret is None else secret.get_secret_value()


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once. Tests build their own `Settings` instead."""
    return Settings()

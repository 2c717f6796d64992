"""The periodic side work: the lease reaper, ready-index reconciliation and output retention, each
run as the beat runs it, against the real database and Redis."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from task_helpers import T0, make_settings, submit, succeed, user

from kiln.tasks import (
    Context,
    beat_schedule,
    celery_config,
    clean_up,
    clean_up_checkpoints,
    reap_leases,
    reconcile,
)
from scheduler import queue_index
from storage import lifecycle, queries
from storage.outputs import checkpoint_key, thumbnail_key, video_key
from storage.tables import Job, JobState, utcnow


def _ready_ids(ctx: Context) -> set[str]:
    return {m.decode() for key in queue_index.ready_keys(ctx.settings.redis_prefix)
            for m in ctx.redis.zrange(key, 0, -1)}


def test_reaper_requeues_lapsed_leases_into_the_ready_index_and_reports_finished_ones(
        ctx: Context) -> None:
    with ctx.sessions() as s:
        lapsed = submit(s).id
        last_try = submit(s, max_attempts=1, webhook_url="http://127.0.0.1:9/hook").id
        quiet_dead = submit(s, max_attempts=1).id
        past_deadline = submit(s, deadline=T0 + timedelta(seconds=30),
                               webhook_url="http://127.0.0.1:9/hook").id
        healthy = submit(s).id
        for job_id in (lapsed, last_try, quiet_dead):
            assert lifecycle.claim_job(s, job_id, worker_group_id="g", lease_seconds=60, now=T0)
        assert lifecycle.claim_job(s, healthy, worker_group_id="g", lease_seconds=600, now=T0)

    out = reap_leases(ctx, now=T0 + timedelta(minutes=2))

    assert out.requeued == [lapsed]
    assert sorted(out.dead) == sorted([last_try, quiet_dead])
    assert out.expired == [past_deadline] and out.cancelled == []
    # Only the newly finished jobs with a webhook are handed to webhook delivery.
    assert sorted(out.notify) == sorted([last_try, past_deadline])
    assert _ready_ids(ctx) == {lapsed}
    with ctx.sessions() as s:
        states = {j: s.get(Job, j).state for j in (lapsed, last_try, past_deadline, healthy)}  # type: ignore[union-attr]
    assert states == {lapsed: "queued", last_try: "dead", past_deadline: "expired",
                      healthy: "running"}
    # Run again: nothing left to do.
    again = reap_leases(ctx, now=T0 + timedelta(minutes=2))
    assert (again.requeued, again.dead, again.expired, again.notify) == ([], [], [], [])


def test_reconciliation_restores_a_flushed_index_and_drops_stale_entries(ctx: Context) -> None:
    with ctx.sessions() as s:
        queued = [submit(s).id, submit(s, priority=9).id]
        done = submit(s)
        succeed(ctx, s, done.id)
    # Redis lost the queued jobs, and still lists the finished one.
    ctx.redis.zadd(queue_index.ready_key(ctx.settings.redis_prefix, done.class_, done.priority),
                   {done.id: 0})

    out = reconcile(ctx)

    assert (out.added, out.removed) == (2, 1)
    assert _ready_ids(ctx) == set(queued)


def test_retention_deletes_old_outputs_and_keeps_the_rows_and_newer_outputs(
        ctx: Context) -> None:
    now = utcnow()
    with ctx.sessions() as s:
        old = submit(s, now=now - timedelta(days=40)).id
        succeed(ctx, s, old, now=now - timedelta(days=40))
        recent = submit(s, now=now - timedelta(days=10)).id
        succeed(ctx, s, recent, now=now - timedelta(days=10))
        running = submit(s, now=now - timedelta(days=40)).id
        assert lifecycle.claim_job(s, running, worker_group_id="g", lease_seconds=60,
                                   now=now - timedelta(days=40))

    assert clean_up(ctx, now=now) == [old]  # retention_days defaults to 30

    assert not ctx.store.exists(video_key(old)) and not ctx.store.exists(thumbnail_key(old))
    assert ctx.store.exists(video_key(recent)) and ctx.store.exists(thumbnail_key(recent))
    with ctx.sessions() as s:
        row = s.get(Job, old)
        assert row is not None and row.state == JobState.SUCCEEDED
        assert (row.output_video_key, row.output_thumbnail_key) == (None, None)
        assert [e.kind for e in queries.job_events(s, old)][-1] == "purged"
        kept = s.get(Job, recent)
        assert kept is not None and kept.output_video_key == video_key(recent)
    assert clean_up(ctx, now=now) == []  # idempotent


def test_checkpoints_no_attempt_will_resume_are_deleted_and_the_others_kept(
        ctx: Context) -> None:
    with ctx.sessions() as s:
        queued = submit(s).id  # handed back: its next attempt resumes from the checkpoint
        running = submit(s).id
        assert lifecycle.claim_job(s, running, worker_group_id="g", lease_seconds=600)
        dead = submit(s, max_attempts=1).id
        assert lifecycle.claim_job(s, dead, worker_group_id="g", lease_seconds=60, now=T0)
        cancelled = submit(s).id
        assert lifecycle.request_cancel(s, cancelled, user(s, "alice")) is not None
    reap_leases(ctx, now=T0 + timedelta(minutes=2))  # "dead" lapses on its last attempt
    gone = "0" * 20  # a checkpoint whose job is no longer in the database
    for job_id in (queued, running, dead, cancelled, gone):
        ctx.store.put_bytes(checkpoint_key(job_id), b"state")
    ctx.store.put_bytes("videos/" + queued + ".mp4", b"not a checkpoint")

    assert clean_up_checkpoints(ctx) == sorted([cancelled, dead, gone])

    assert [k for k in ctx.store.keys("checkpoints")] == sorted(
        checkpoint_key(j) for j in (queued, running))
    assert clean_up_checkpoints(ctx) == []


def test_retention_of_zero_days_keeps_everything(ctx: Context, tmp_path: object) -> None:
    ctx.settings = make_settings(ctx.settings.database_url, ctx.settings.redis_prefix,
                                 tmp_path, retention_days=0)  # type: ignore[arg-type]
    now = utcnow()
    with ctx.sessions() as s:
        ancient = submit(s, now=now - timedelta(days=3000)).id
        succeed(ctx, s, ancient, now=now - timedelta(days=3000))
    assert clean_up(ctx, now=now) == []
    assert ctx.store.exists(video_key(ancient))


def test_beat_runs_every_periodic_task_at_its_configured_interval(ctx: Context) -> None:
    schedule = beat_schedule(ctx.settings)
    assert {name: (entry["task"], entry["schedule"]) for name, entry in schedule.items()} == {
        "reap-leases": ("kiln.reap_leases", 15.0),
        "reconcile-ready-index": ("kiln.reconcile_ready_index", 60.0),
        # Every webhook retry goes out through the sweep: within 5 s of its time.
        "sweep-webhooks": ("kiln.sweep_webhooks", 5.0),
        "clean-up-outputs": ("kiln.clean_up_outputs", 3600.0),
    }
    # A run that could not start within its period is dropped rather than piled up.
    assert all(e["options"]["expires"] == e["schedule"] for e in schedule.values())


def test_beat_keeps_its_schedule_file_under_the_deployments_data_directory(
        tmp_path: Path) -> None:
    settings = make_settings("sqlite:///unused.db", "kiln:a/b:", tmp_path,
                             data_dir=tmp_path / "data")
    path = Path(celery_config(settings)["beat_schedule_filename"])
    assert path == (tmp_path / "data" / "celery-beat-kiln_a_b").absolute()

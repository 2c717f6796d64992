"""The job repository on SQLite and PostgreSQL: submit, read, list, cancel, guarded transitions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from storage import idempotency, lifecycle, queries, submission
from storage.submission import JobSpec
from storage.tables import Job, JobClass, JobState, User
from storage.users import get_or_create_user

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def spec(**overrides: object) -> JobSpec:
    fields: dict[str, object] = dict(
        model="kiln-tiny", prompt="a red circle", width=64, height=64, num_frames=9, fps=8,
        num_inference_steps=4, guidance_scale=5.0, seed=1,
    )
    fields.update(overrides)
    return JobSpec(**fields)  # type: ignore[arg-type]


def user(session: Session, name: str = "alice", admin: bool = False) -> User:
    u = get_or_create_user(session, name, is_admin=admin)
    session.commit()
    return u


def submit(session: Session, owner: User, now: datetime = T0, **overrides: object) -> Job:
    return submission.create_job(session, owner, spec(**overrides), request_hash="h", now=now).job


def test_created_job_is_queued_with_seed_and_a_created_event(session: Session) -> None:
    alice = user(session)
    job = submission.create_job(session, alice, spec(seed=None), request_hash="h", now=T0).job
    assert job.state == "queued" and job.attempts == 0 and job.progress_total == 4
    assert submission.is_job_id(job.id)
    assert 0 <= job.seed < 2**31
    assert [e.kind for e in queries.job_events(session, job.id)] == ["created"]
    assert queries.get_job(session, job.id, alice).created_at == T0  # type: ignore[union-attr]


def test_other_users_cannot_see_a_job_but_admins_can(session: Session) -> None:
    alice, bob, root = user(session), user(session, "bob"), user(session, "root", admin=True)
    job = submit(session, alice)
    assert queries.get_job(session, job.id, bob) is None
    assert queries.get_job(session, job.id, root) is not None
    assert lifecycle.request_cancel(session, job.id, bob) is None
    assert queries.list_jobs(session, bob) == ([], None)
    assert [j.id for j in queries.list_jobs(session, root)[0]] == [job.id]


def test_path_like_ids_are_not_found(session: Session) -> None:
    alice = user(session)
    for bad in ["../../etc/passwd", "", "A" * 20, "x" * 500, "%00"]:
        assert queries.get_job(session, bad, alice) is None


def test_idempotency_same_key_same_body_returns_same_job_other_body_conflicts(
    session: Session,
) -> None:
    alice, bob = user(session), user(session, "bob")
    first = submission.create_job(session, alice, spec(), request_hash="a", idempotency_key="k1")
    again = submission.create_job(session, alice, spec(), request_hash="a", idempotency_key="k1")
    assert first.created and not again.created and again.job.id == first.job.id
    with pytest.raises(idempotency.IdempotencyConflict):
        submission.create_job(session, alice, spec(), request_hash="b", idempotency_key="k1")
    # Keys are per user: bob's k1 is a different job.
    other = submission.create_job(session, bob, spec(), request_hash="a", idempotency_key="k1")
    assert other.created and other.job.id != first.job.id
    assert session.scalar(select(Job.id).where(Job.owner_id == alice.id).limit(2)) is not None
    assert len(list(session.scalars(select(Job)))) == 2


def test_queue_limit_refuses_new_jobs_but_not_idempotent_replays(session: Session) -> None:
    alice = user(session)
    submission.create_job(session, alice, spec(), request_hash="a", idempotency_key="k",
                          max_queued=2)
    submission.create_job(session, alice, spec(), request_hash="b", max_queued=2)
    with pytest.raises(submission.QueueFull):
        submission.create_job(session, alice, spec(), request_hash="c", max_queued=2)
    replay = submission.create_job(session, alice, spec(), request_hash="a", idempotency_key="k",
                                   max_queued=2)
    assert not replay.created


def test_claim_is_exclusive_and_sets_lease_token_and_attempt(session: Session) -> None:
    job = submit(session, user(session))
    claim = lifecycle.claim_job(session, job.id, worker_group_id="g1", rank=1, lease_seconds=30,
                                now=T0)
    assert claim is not None
    assert claim.job.state == "running" and claim.job.attempts == 1 and claim.job.rank == 1
    assert claim.lease_expires_at == T0 + timedelta(seconds=30)
    assert lifecycle.claim_job(session, job.id, worker_group_id="g2", lease_seconds=30) is None
    # The claim is written with its event, and the session sees the claimed row.
    events = queries.job_events(session, job.id)
    assert [(e.kind, e.attempt) for e in events] == [("created", 0), ("claimed", 1)]
    assert events[1].detail == {"worker_group_id": "g1", "rank": 1} and events[1].at == T0
    assert session.get(type(job), job.id) is claim.job and claim.job.started_at == T0
    assert claim.job.progress_total == claim.job.num_inference_steps


def test_claim_respects_not_before_deadline_and_cancel(session: Session) -> None:
    alice = user(session)
    later = submit(session, alice, not_before=T0 + timedelta(hours=1))
    assert lifecycle.claim_job(session, later.id, worker_group_id="g", lease_seconds=30,
                               now=T0) is None
    assert lifecycle.claim_job(session, later.id, worker_group_id="g", lease_seconds=30,
                               now=T0 + timedelta(hours=2)) is not None
    overdue = submit(session, alice, deadline=T0 + timedelta(minutes=1))
    assert lifecycle.claim_job(session, overdue.id, worker_group_id="g", lease_seconds=30,
                               now=T0 + timedelta(minutes=2)) is None
    reaped = lifecycle.reap(session, now=T0 + timedelta(minutes=2))
    assert reaped.expired == [overdue.id]
    assert session.get(Job, overdue.id).state == "expired"  # type: ignore[union-attr]


def test_stale_attempt_token_cannot_heartbeat_or_finish_after_requeue(session: Session) -> None:
    job = submit(session, user(session))
    first = lifecycle.claim_job(session, job.id, worker_group_id="g1", lease_seconds=10, now=T0)
    assert first is not None
    beat = lifecycle.heartbeat(session, job.id, first.attempt_token, step=2, lease_seconds=10,
                               now=T0 + timedelta(seconds=5))
    assert beat is not None and not beat.cancel_requested
    # The worker goes silent; the reaper gives the job back and another worker takes it.
    reaped = lifecycle.reap(session, now=T0 + timedelta(seconds=60))
    assert [j.id for j in reaped.requeued] == [job.id]
    second = lifecycle.claim_job(session, job.id, worker_group_id="g2", lease_seconds=10,
                                 now=T0 + timedelta(seconds=61))
    assert second is not None and second.attempt_token != first.attempt_token
    assert second.job.attempts == 2 and second.job.progress_step == 0
    # The first worker wakes up: every write it tries is refused and changes nothing.
    assert lifecycle.heartbeat(session, job.id, first.attempt_token, step=4,
                               lease_seconds=10) is None
    assert not lifecycle.finish_succeeded(session, job.id, first.attempt_token, video_key="v")
    assert lifecycle.fail_job(session, job.id, first.attempt_token, error="boom") is None
    session.expire_all()
    row = session.get(Job, job.id)
    assert row is not None
    assert (row.state, row.worker_group_id, row.attempt_token) == (
        "running", "g2", second.attempt_token)
    assert row.output_video_key is None
    assert lifecycle.finish_succeeded(session, job.id, second.attempt_token,
                                      video_key="videos/x.mp4", now=T0 + timedelta(seconds=71))
    session.expire_all()
    row = session.get(Job, job.id)
    assert row is not None and row.state == "succeeded"
    assert row.render_seconds == pytest.approx(10.0)
    assert row.progress_step == row.progress_total == 4
    kinds = [e.kind for e in queries.job_events(session, job.id)]
    assert kinds == ["created", "claimed", "requeued", "claimed", "succeeded"]


def test_lost_lease_on_the_last_attempt_marks_the_job_dead(session: Session) -> None:
    alice = user(session)
    job = submission.create_job(session, alice, spec(), request_hash="h", max_attempts=2,
                                now=T0).job
    now = T0
    for _ in range(2):
        assert lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=5, now=now)
        now += timedelta(seconds=10)
        lifecycle.reap(session, now=now)
    session.expire_all()
    row = session.get(Job, job.id)
    assert row is not None and row.state == "dead" and row.attempts == 2
    assert "lease expired" in (row.error or "")
    assert lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=5) is None


def test_retryable_failure_requeues_until_attempts_run_out(session: Session) -> None:
    job = submission.create_job(session, user(session), spec(), request_hash="h",
                                max_attempts=2).job
    c1 = lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=30)
    assert c1 is not None
    assert lifecycle.fail_job(session, job.id, c1.attempt_token, error="oom", retryable=True) == (
        JobState.QUEUED)
    c2 = lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=30)
    assert c2 is not None
    assert lifecycle.fail_job(session, job.id, c2.attempt_token, error="oom", retryable=True) == (
        JobState.DEAD)
    job2 = submit(session, user(session))
    c3 = lifecycle.claim_job(session, job2.id, worker_group_id="g", lease_seconds=30)
    assert c3 is not None
    assert lifecycle.fail_job(session, job2.id, c3.attempt_token,
                              error="prompt has no subject") == JobState.FAILED
    session.expire_all()
    assert session.get(Job, job2.id).error == "prompt has no subject"  # type: ignore[union-attr]


def test_cancel_queued_is_immediate_running_is_flagged_for_the_rank(session: Session) -> None:
    alice = user(session)
    queued = submit(session, alice)
    cancelled = lifecycle.request_cancel(session, queued.id, alice)
    assert cancelled is not None and cancelled[1] is True
    assert cancelled[0].state == "cancelled"
    assert lifecycle.claim_job(session, queued.id, worker_group_id="g", lease_seconds=30) is None

    running = submit(session, alice)
    claim = lifecycle.claim_job(session, running.id, worker_group_id="g", lease_seconds=30)
    assert claim is not None
    flagged = lifecycle.request_cancel(session, running.id, alice)
    assert flagged is not None and flagged[1] is False
    assert (flagged[0].state, flagged[0].cancel_requested) == ("running", True)
    beat = lifecycle.heartbeat(session, running.id, claim.attempt_token, step=1, lease_seconds=30)
    assert beat is not None and beat.cancel_requested
    assert lifecycle.finish_cancelled(session, running.id, claim.attempt_token)
    session.expire_all()
    assert session.get(Job, running.id).state == "cancelled"  # type: ignore[union-attr]


def test_list_pages_with_cursor_newest_first_without_gaps_or_repeats(session: Session) -> None:
    alice = user(session)
    made = [submit(session, alice, now=T0 + timedelta(seconds=i)).id for i in range(5)]
    seen: list[str] = []
    cursor = None
    for _ in range(5):
        page, cursor = queries.list_jobs(session, alice, limit=2, cursor=cursor)
        seen += [j.id for j in page]
        if cursor is None:
            break
    assert seen == list(reversed(made))
    oldest_first, _ = queries.list_jobs(session, alice, limit=10, newest_first=False)
    assert [j.id for j in oldest_first] == made
    lifecycle.request_cancel(session, made[0], alice)
    assert [j.id for j in queries.list_jobs(session, alice, states=["cancelled"])[0]] == [made[0]]
    with pytest.raises(ValueError, match="cursor"):
        queries.list_jobs(session, alice, cursor="not-a-cursor")


def test_queue_position_orders_interactive_then_priority_then_age(session: Session) -> None:
    alice = user(session)
    batch_hi = submit(session, alice, now=T0, job_class=JobClass.BATCH, priority=9)
    inter_lo_old = submit(session, alice, now=T0, priority=1)
    inter_lo_new = submit(session, alice, now=T0 + timedelta(seconds=1), priority=1)
    inter_hi = submit(session, alice, now=T0 + timedelta(seconds=2), priority=8)
    positions = {j.id: queries.queue_position(session, j)
                 for j in (batch_hi, inter_lo_old, inter_lo_new, inter_hi)}
    assert positions == {inter_hi.id: 0, inter_lo_old.id: 1, inter_lo_new.id: 2, batch_hi.id: 3}


def test_delete_hides_finished_jobs_and_refuses_running_ones(session: Session) -> None:
    alice = user(session)
    job = submit(session, alice)
    claim = lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=30)
    assert claim is not None
    with pytest.raises(lifecycle.JobBusy):
        lifecycle.delete_job(session, job.id, alice)
    assert lifecycle.finish_cancelled(session, job.id, claim.attempt_token)
    deleted = lifecycle.delete_job(session, job.id, alice)
    assert deleted is not None and deleted[0].deleted_at is not None
    assert queries.get_job(session, job.id, alice) is None

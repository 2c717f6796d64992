"""An attempt that resumed from a checkpoint, and a job suspended in place for an interactive job
and then continued: `lifecycle.note_resumed`, `note_preempted`, `note_continued`, each guarded by
the attempt token like every other write of a running job."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from storage import lifecycle, queries, submission
from storage.submission import JobSpec
from storage.tables import Job, User
from storage.users import get_or_create_user

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def user(session: Session) -> User:
    u = get_or_create_user(session, "alice")
    session.commit()
    return u


def submit(session: Session, owner: User, num_inference_steps: int = 4) -> Job:
    spec = JobSpec(model="kiln-tiny", prompt="a red circle", width=64, height=64, num_frames=9,
                   fps=8, num_inference_steps=num_inference_steps, guidance_scale=5.0, seed=1)
    return submission.create_job(session, owner, spec, request_hash="h", now=T0).job


def _row(session: Session, job_id: str) -> Job:
    session.expire_all()
    row = session.get(Job, job_id)
    assert row is not None
    return row


def test_a_new_job_starts_at_step_zero_never_preempted(session: Session) -> None:
    job = submit(session, user(session))
    row = _row(session, job.id)
    assert (row.resumed_from_step, row.preemptions) == (None, 0)


def test_resumed_preempted_and_continued_write_their_events(session: Session) -> None:
    job = submit(session, user(session), num_inference_steps=30)
    claim = lifecycle.claim_job(session, job.id, worker_group_id="g", rank=0, lease_seconds=60,
                                now=T0)
    assert claim is not None and claim.job.resumed_from_step is None
    token = claim.attempt_token
    t = T0 + timedelta(seconds=1)
    assert lifecycle.note_resumed(session, job.id, token, step=20, now=t)
    assert lifecycle.note_preempted(session, job.id, token, by_job="interactive00000000001",
                                    step=24, now=t + timedelta(seconds=1))
    assert lifecycle.note_continued(session, job.id, token, step=24, now=t + timedelta(seconds=2))
    assert lifecycle.note_preempted(session, job.id, token, by_job="interactive00000000002",
                                    step=27, now=t + timedelta(seconds=3))
    row = _row(session, job.id)
    assert (row.state, row.attempt_token) == ("running", token)  # no state change
    assert (row.resumed_from_step, row.preemptions) == (20, 2)
    events = queries.job_events(session, job.id)
    assert [(e.kind, e.attempt) for e in events] == [
        ("created", 0), ("claimed", 1), ("resumed", 1), ("preempted", 1), ("continued", 1),
        ("preempted", 1)]
    assert events[2].detail == {"step": 20, "total_steps": 30} and events[2].at == t
    assert events[3].detail == {"step": 24, "total_steps": 30,
                                "by_job": "interactive00000000001"}
    assert events[4].detail == {"step": 24, "total_steps": 30}


def test_a_stale_attempt_token_changes_nothing(session: Session) -> None:
    job = submit(session, user(session))
    first = lifecycle.claim_job(session, job.id, worker_group_id="g1", lease_seconds=10, now=T0)
    assert first is not None
    assert lifecycle.note_resumed(session, job.id, first.attempt_token, step=2, now=T0)
    # The first worker goes silent; the job is requeued and claimed again.
    lifecycle.reap(session, now=T0 + timedelta(seconds=60))
    second = lifecycle.claim_job(session, job.id, worker_group_id="g2", lease_seconds=10,
                                 now=T0 + timedelta(seconds=61))
    assert second is not None
    before = [e.kind for e in queries.job_events(session, job.id)]
    stale = first.attempt_token
    assert not lifecycle.note_resumed(session, job.id, stale, step=3)
    assert not lifecycle.note_preempted(session, job.id, stale, by_job="x" * 20, step=3)
    assert not lifecycle.note_continued(session, job.id, stale, step=3)
    assert not lifecycle.note_resumed(session, job.id, "no-such-token", step=3)
    assert not lifecycle.note_resumed(session, "nosuchjob", second.attempt_token, step=3)
    row = _row(session, job.id)
    assert (row.resumed_from_step, row.preemptions) == (None, 0)
    assert [e.kind for e in queries.job_events(session, job.id)] == before
    # The current attempt still can.
    assert lifecycle.note_preempted(session, job.id, second.attempt_token, by_job="x" * 20,
                                    step=1)
    assert _row(session, job.id).preemptions == 1


def test_a_finished_job_takes_no_notes(session: Session) -> None:
    job = submit(session, user(session))
    claim = lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=10, now=T0)
    assert claim is not None
    assert lifecycle.finish_succeeded(session, job.id, claim.attempt_token, video_key="v.mp4")
    assert not lifecycle.note_continued(session, job.id, claim.attempt_token, step=4)
    assert not lifecycle.note_preempted(session, job.id, claim.attempt_token, by_job="y" * 20,
                                        step=4)
    assert _row(session, job.id).preemptions == 0
    assert queries.job_events(session, job.id)[-1].kind == "succeeded"


def test_each_claim_clears_where_the_attempt_resumed_from(session: Session) -> None:
    job = submit(session, user(session))
    first = lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=10, now=T0)
    assert first is not None
    assert lifecycle.note_resumed(session, job.id, first.attempt_token, step=3)
    assert lifecycle.note_preempted(session, job.id, first.attempt_token, by_job="z" * 20,
                                    step=3)
    assert lifecycle.fail_job(session, job.id, first.attempt_token, error="stopped",
                              retryable=True, charged=False) == "queued"
    # Back in the queue, the row still says where its last attempt resumed from.
    assert _row(session, job.id).resumed_from_step == 3
    second = lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=10,
                                 now=T0 + timedelta(seconds=1))
    assert second is not None and second.job.resumed_from_step is None
    row = _row(session, job.id)
    # The preemptions are the job's, over all its attempts.
    assert (row.resumed_from_step, row.preemptions, row.attempts) == (None, 1, 2)


@pytest.mark.parametrize("bad", [-1, 2.5])
def test_a_step_must_be_a_whole_number_of_steps(session: Session, bad: object) -> None:
    job = submit(session, user(session))
    claim = lifecycle.claim_job(session, job.id, worker_group_id="g", lease_seconds=10, now=T0)
    assert claim is not None
    with pytest.raises(ValueError, match="step"):
        lifecycle.note_resumed(session, job.id, claim.attempt_token, step=bad)  # type: ignore[arg-type]
    assert _row(session, job.id).resumed_from_step is None

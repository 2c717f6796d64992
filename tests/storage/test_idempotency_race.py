"""Two requests with the same idempotency key at once: the one that loses the unique constraint
replays what the winner made (or is refused for another body), for jobs and for batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage import batches, idempotency, submission
from storage.submission import JobSpec
from storage.tables import Batch, Job, User
from storage.users import get_or_create_user

if TYPE_CHECKING:
    from tests.conftest import Database


def spec() -> JobSpec:
    return JobSpec(model="kiln-tiny", prompt="a red circle", width=64, height=64, num_frames=9,
                   fps=8, num_inference_steps=4, guidance_scale=5.0, seed=1)


def _owner(session: Session) -> User:
    owner = get_or_create_user(session, "alice")
    session.commit()
    return owner


def _after_a_rival(db: Database, owner: User, step: Any,
                   rival: Any) -> tuple[Any, list[Any]]:
    """``step`` (a function the request calls after it found no row with its key), wrapped so
    that its first call lets a concurrent request make that row first: ``rival(session, owner)``.
    Returns the wrapper and a list that will hold what the rival made."""
    made: list[Any] = []
    raced = False

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal raced
        if not raced:
            raced = True  # before the rival runs: it calls ``step`` too
            with db.session() as other:
                made.append(rival(other, other.get(User, owner.id)))
        return step(*args, **kwargs)

    return wrapped, made


@pytest.mark.parametrize("winner_hash", ["a", "b"])
def test_a_job_request_that_loses_the_key_race_replays_or_conflicts(
    db: Database, session: Session, monkeypatch: pytest.MonkeyPatch, winner_hash: str,
) -> None:
    owner = _owner(session)
    step, winner = _after_a_rival(
        db, owner, submission.new_job_row, lambda s, user: submission.create_job(
            s, user, spec(), request_hash=winner_hash, idempotency_key="k"))
    monkeypatch.setattr(submission, "new_job_row", step)
    if winner_hash == "a":
        result = submission.create_job(session, owner, spec(), request_hash="a",
                                       idempotency_key="k")
        assert not result.created and result.job.id == winner[0].job.id
    else:
        with pytest.raises(idempotency.IdempotencyConflict):
            submission.create_job(session, owner, spec(), request_hash="a", idempotency_key="k")
    assert session.scalar(select(func.count()).select_from(Job)) == 1


@pytest.mark.parametrize("winner_hash", ["a", "b"])
def test_a_batch_request_that_loses_the_key_race_replays_or_conflicts(
    db: Database, session: Session, monkeypatch: pytest.MonkeyPatch, winner_hash: str,
) -> None:
    owner = _owner(session)
    step, winner = _after_a_rival(
        db, owner, batches.check_queue_room, lambda s, user: batches.create_batch(
            s, user, [spec(), spec()], request_hash=winner_hash, idempotency_key="k"))
    monkeypatch.setattr(batches, "check_queue_room", step)
    if winner_hash == "a":
        result = batches.create_batch(session, owner, [spec(), spec()], request_hash="a",
                                      idempotency_key="k", max_queued=100)
        assert not result.created and result.jobs == []
        assert result.batch.id == winner[0].batch.id
    else:
        with pytest.raises(idempotency.IdempotencyConflict):
            batches.create_batch(session, owner, [spec(), spec()], request_hash="a",
                                 idempotency_key="k", max_queued=100)
    assert session.scalar(select(func.count()).select_from(Batch)) == 1
    assert session.scalar(select(func.count()).select_from(Job)) == 2

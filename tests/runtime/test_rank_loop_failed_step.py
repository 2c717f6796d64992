"""A job whose step fails keeps its checkpoint until the failure has reached rank 0.

A step also fails when a peer of the rank dies under the step's collectives (sp > 1, or a
gather of allgather weights): the group then fails at the turn's gather, before the failure is
recorded, and the launcher gives the job another attempt, which must find the newest checkpoint.
Only once the turn's messages are through (`RankLoop.reported`) is the job over and its
checkpoint deleted. One rank, no process group: the failure is injected into the pipeline."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from common.families import TINY_MODEL
from runtime.pipelines.base import VideoRequest
from runtime.platform import get_platform
from runtime.rank_loop import Ended, RankLoop, StepPlan, Ticket
from runtime.render import load_pipeline

REQUEST = VideoRequest(prompt="a red circle moving left", width=64, height=64, num_frames=5,
                       num_inference_steps=6, seed=1)


class MemoryCheckpoints:
    """`runtime.rank_loop.Checkpoints` in a dict; events say when the thread saved or deleted."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.saved = threading.Event()
        self.deleted = threading.Event()

    def load(self, job_id: str) -> bytes | None:
        return self.blobs.get(job_id)

    def save(self, job_id: str, blob: bytes) -> None:
        self.blobs[job_id] = blob
        self.saved.set()

    def delete(self, job_id: str) -> None:
        self.blobs.pop(job_id, None)
        self.deleted.set()


def _write(frames: Any, job_id: str, fps: int) -> tuple[str, str]:
    return f"{job_id}.mp4", f"{job_id}.png"


@pytest.mark.parametrize("reported", [False, True], ids=["group-failed", "failure-reported"])
def test_a_failed_steps_checkpoint_is_deleted_only_once_the_failure_is_reported(
        reported: bool) -> None:
    pipe = load_pipeline(TINY_MODEL)
    store = MemoryCheckpoints()
    loop = RankLoop(0, pipe, _write, get_platform("cpu"), checkpoints=store,
                    checkpoint_every_steps=2)
    try:
        loop.apply(StepPlan(step=True, assign={0: Ticket(job_id="a", attempt_token="a1",
                                                         request=REQUEST)}))
        assert loop.step() is None and loop.step() is None
        assert store.saved.wait(10), "no checkpoint of step 2"

        def lost_peer(*args: Any) -> None:
            raise RuntimeError("Connection closed by peer")  # as gloo says it

        pipe.step = lost_peer  # type: ignore[method-assign]
        ended = loop.step()
        assert isinstance(ended, Ended) and ended.outcome == "failed", ended
        assert loop.jobs == [] and loop.current is None
        if reported:
            loop.reported()  # the turn's gather went through: the failure is recorded
            assert store.deleted.wait(10) and "a" not in store.blobs
        else:  # the gather failed (the peer is gone): the next attempt resumes from step 2
            assert not store.deleted.wait(0.5)
            assert "a" in store.blobs
    finally:
        loop.close()
    assert ("a" in store.blobs) is not reported

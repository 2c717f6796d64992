"""A rank's writer thread: a write the storage refuses keeps the job and tries it again with a
backoff, never rendering it again; a rank holds a bounded number of finished jobs; a job given
up is dropped; leaving gives up what is still held without waiting out a backoff. The leader's
preview thread stores a kiln-tiny job's preview every few steps, and a store that refuses one
costs the job nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runtime import rank_loop
from runtime.pipelines.base import DenoiseState, VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from runtime.rank_loop import Ended, RankLoop, Rendered, StepPlan, Ticket
from runtime.sequence import SOLO, Layout

STEPS = 2


class CountingPipe:
    """Two steps a job, frames of zeros; counts the jobs it prepared (renders)."""

    handles: list[Any] = []  # no streamed transformer
    last_step_figures: dict[str, int] = {}  # a step's counts (none here)

    def __init__(self) -> None:
        self.prepared: list[str] = []

    def handles_needed(self, state: DenoiseState) -> list[bool]:
        return []

    def prepare(self, request: VideoRequest) -> DenoiseState:
        self.prepared.append(request.prompt)
        return DenoiseState(request=request, latents=torch.zeros(1), num_inference_steps=STEPS)

    def step(self, state: DenoiseState, active: Any = None) -> None:
        state.step_index += 1

    def idle_step(self, active: Any = None) -> None:
        pass

    def decode(self, state: DenoiseState) -> torch.Tensor:
        return torch.zeros((3, 8, 8, 3))

    def close(self) -> None:
        pass


class FlakyWrite:
    """The ranks' ``write``: refuses (OSError) while ``failing``; ``error`` replaces the
    refusal with another exception."""

    def __init__(self) -> None:
        self.failing = True
        self.error: Exception | None = None
        self.calls: list[str] = []
        self.discarded: list[str] = []
        self.closed = False
        self.lock = threading.Lock()

    def __call__(self, frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        with self.lock:
            self.calls.append(job_id)
        assert frames.dtype.name == "uint8" and frames.shape == (3, 8, 8, 3)
        if self.error is not None:
            raise self.error
        if self.failing:
            raise OSError(28, "No space left on device")
        return f"videos/{job_id}.mp4", f"thumbnails/{job_id}.png"

    def tries(self, job_id: str) -> int:
        with self.lock:
            return self.calls.count(job_id)

    def discard(self, job_id: str) -> None:
        self.discarded.append(job_id)

    def close(self) -> None:
        self.closed = True


PLATFORM = SimpleNamespace(mem_get_info=lambda: (1, 2), device="cpu", is_accelerator=False)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_loop, "FIRST_RETRY_SECONDS", 0.05)
    monkeypatch.setattr(rank_loop, "MAX_RETRY_SECONDS", 0.2)
    monkeypatch.setattr(rank_loop, "PREVIEW_MIN_SECONDS", 0.0)


@pytest.fixture
def write() -> FlakyWrite:
    return FlakyWrite()


@pytest.fixture
def loop(write: FlakyWrite) -> Iterator[RankLoop]:
    loop = RankLoop(0, CountingPipe(), write, PLATFORM)  # type: ignore[arg-type]
    yield loop
    loop.close()


def _render(loop: RankLoop, job_id: str) -> Rendered | Ended:
    """Starts ``job_id`` on ``loop`` and steps it to the end; the status it ended with."""
    ticket = Ticket(job_id=job_id, attempt_token=f"t-{job_id}",
                    request=VideoRequest(prompt=job_id, seed=1, width=64, height=64,
                                         num_frames=9, fps=8))
    assert loop.apply(StepPlan(assign={0: ticket}, step=True)) == []
    for _ in range(STEPS - 1):
        assert loop.step() is None
    ended = loop.step()
    assert ended is not None
    loop.reported()  # as the loop does once the turn's messages have reached rank 0
    return ended


def _collect(loop: RankLoop, n: int, timeout: float = 10) -> list[Ended]:
    """The next ``n`` final statuses the writer thread reports."""
    deadline = time.monotonic() + timeout
    got: list[Ended] = []
    while len(got) < n:
        assert time.monotonic() < deadline, got
        got += loop.written(wait=0.1)
    return got


def _until(what: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_refused_write_is_tried_again_until_stored_and_never_rendered_again(
        loop: RankLoop, write: FlakyWrite) -> None:
    assert isinstance(_render(loop, "a"), Rendered)
    _until(lambda: write.tries("a") >= 3)  # 0.05 s, 0.1 s, 0.2 s apart
    report = loop.report()
    assert report.store_error == "OSError: [Errno 28] No space left on device"
    assert report.takes_jobs  # one held: room for one more
    assert loop.written(wait=0.1) == []

    write.failing = False
    _until(lambda: loop.report().store_error is None)
    [done] = loop.written(wait=1)
    assert (done.job_id, done.attempt_token, done.outcome) == ("a", "t-a", "succeeded")
    assert (done.video_key, done.thumbnail_key) == ("videos/a.mp4", "thumbnails/a.png")
    assert loop.pipe.prepared == ["a"]  # type: ignore[attr-defined]
    tries = write.tries("a")
    time.sleep(0.3)
    assert write.tries("a") == tries, "no try after it was stored"


def test_a_rank_holding_its_bound_of_finished_jobs_takes_no_new_one(
        loop: RankLoop, write: FlakyWrite) -> None:
    assert loop.max_held_jobs == rank_loop.MAX_HELD_JOBS == 2
    _render(loop, "a")
    assert loop.report().takes_jobs
    _render(loop, "b")
    assert not loop.report().takes_jobs
    write.failing = False
    assert [st.job_id for st in _collect(loop, 2)] == ["a", "b"]
    assert loop.report().takes_jobs and loop.report().store_error is None


def test_the_held_jobs_are_stored_oldest_first(loop: RankLoop, write: FlakyWrite) -> None:
    _render(loop, "a")
    _render(loop, "b")
    _until(lambda: write.tries("a") >= 2)
    assert write.tries("b") == 0, "the store is tried with the oldest job alone"
    write.failing = False
    assert [st.job_id for st in _collect(loop, 2)] == ["a", "b"]


def test_a_job_given_up_is_dropped_and_its_kept_files_discarded(
        loop: RankLoop, write: FlakyWrite) -> None:
    _render(loop, "a")
    _until(lambda: loop.report().store_error is not None)
    loop.apply(StepPlan(abandon=["a"]))
    assert write.discarded == ["a"]
    assert loop.report().store_error is None and loop.report().takes_jobs
    write.failing = False
    time.sleep(0.4)
    assert loop.written(wait=0.1) == []


def test_frames_that_cannot_be_written_fail_the_job(loop: RankLoop, write: FlakyWrite) -> None:
    write.error = ValueError("needs an even width and height")
    _render(loop, "a")
    [failed] = loop.written(wait=5)
    assert failed.outcome == "failed" and failed.retryable
    assert failed.error == "writing the video failed: needs an even width and height"
    assert write.tries("a") == 1 and loop.report().store_error is None


def test_leaving_gives_up_the_held_jobs_without_waiting_out_the_backoff(
        write: FlakyWrite, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_loop, "FIRST_RETRY_SECONDS", 30.0)
    monkeypatch.setattr(rank_loop, "MAX_RETRY_SECONDS", 30.0)
    loop = RankLoop(0, CountingPipe(), write, PLATFORM)  # type: ignore[arg-type]
    _render(loop, "a")
    _until(lambda: write.tries("a") == 1 and loop.report().store_error is not None)
    started = time.monotonic()
    loop.close()
    assert time.monotonic() - started < 2
    assert write.closed and not loop._writer.is_alive()
    assert write.tries("a") == 1


class PreviewWrite:
    """The ranks' ``write`` for a kiln-tiny job, with previews: records what it was given;
    ``preview_error``, when set, is what storing a preview raises."""

    def __init__(self) -> None:
        self.frames: dict[str, Any] = {}
        self.previews: list[tuple[str, int, int, Any]] = []  # (job, step, steps, frame)
        self.dropped: list[str] = []
        self.preview_error: Exception | None = None
        self.lock = threading.Lock()

    def __call__(self, frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        self.frames[job_id] = frames
        return f"videos/{job_id}.mp4", f"thumbnails/{job_id}.png"

    def preview(self, frame: Any, job_id: str, step: int, num_inference_steps: int) -> None:
        if self.preview_error is not None:
            raise self.preview_error
        with self.lock:
            self.previews.append((job_id, step, num_inference_steps, frame))

    def drop_preview(self, job_id: str) -> None:
        with self.lock:
            self.dropped.append(job_id)

    def steps(self) -> list[int]:
        with self.lock:
            return [p[1] for p in self.previews]


TINY_REQUEST = VideoRequest(prompt="a red circle moving left", seed=3, width=64, height=64,
                            num_frames=9, fps=8, num_inference_steps=6)


@pytest.fixture(scope="module")
def tiny_pipe() -> Any:
    # Resident: a loop's close() closes its pipeline, which is then nothing to close.
    return TinyPipeline.load(offload=False)


def _tiny_job(loop: RankLoop, job_id: str, between: Any = None) -> Rendered | Ended:
    """Runs ``job_id`` (TINY_REQUEST) on ``loop``; ``between(step)`` after each step but the
    last; the status it ended with."""
    loop.apply(StepPlan(assign={0: Ticket(job_id=job_id, attempt_token=f"t-{job_id}",
                                          request=TINY_REQUEST)}, step=True))
    for step in range(1, TINY_REQUEST.num_inference_steps):
        assert loop.step() is None
        if between is not None:
            between(step)
    ended = loop.step()
    assert ended is not None
    loop.reported()
    return ended


def test_the_leader_stores_a_kiln_tiny_preview_every_n_steps_and_drops_it_at_the_end(
        tiny_pipe: Any) -> None:
    write = PreviewWrite()
    loop = RankLoop(0, tiny_pipe, write, PLATFORM, preview_every_steps=2)  # type: ignore[arg-type]
    try:
        def caught_up(step: int) -> None:  # the thread keeps only the newest: see each one
            _until(lambda: write.steps() == list(range(2, step + 1, 2)))

        assert isinstance(_tiny_job(loop, "p", caught_up), Rendered)
        [done] = _collect(loop, 1)
        assert done.outcome == "succeeded"
        _until(lambda: write.dropped == ["p"])
    finally:
        loop.close()
    # Steps 2 and 4 of 6 (the sixth is the video itself), each a frame of the clip's size.
    assert [(j, s, n) for j, s, n, _ in write.previews] == [("p", 2, 6), ("p", 4, 6)]
    for *_, frame in write.previews:
        assert frame.shape == (64, 64, 3) and frame.dtype.name == "uint8"
    assert not (write.previews[0][3] == write.previews[1][3]).all()

    # The same job without previews renders the same frames, bit for bit.
    plain = PreviewWrite()
    loop = RankLoop(0, tiny_pipe, plain, PLATFORM)  # type: ignore[arg-type]
    try:
        _tiny_job(loop, "p")
        _collect(loop, 1)
    finally:
        loop.close()
    assert plain.previews == [] and plain.dropped == []
    assert (plain.frames["p"] == write.frames["p"]).all()


def test_a_rank_takes_previews_at_most_every_preview_min_seconds(
        tiny_pipe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_loop, "PREVIEW_MIN_SECONDS", 60.0)
    write = PreviewWrite()
    loop = RankLoop(0, tiny_pipe, write, PLATFORM, preview_every_steps=1)  # type: ignore[arg-type]
    try:
        _tiny_job(loop, "r", lambda step: _until(lambda: len(write.steps()) == 1))
        _collect(loop, 1)
        _until(lambda: write.dropped == ["r"])
    finally:
        loop.close()
    assert write.steps() == [1]  # steps 2 to 5 came within the minute


def test_a_preview_the_store_refuses_is_logged_and_neither_fails_nor_holds_up_the_job(
        tiny_pipe: Any, caplog: pytest.LogCaptureFixture) -> None:
    write = PreviewWrite()
    write.preview_error = OSError(28, "No space left on device")
    loop = RankLoop(0, tiny_pipe, write, PLATFORM, preview_every_steps=1)  # type: ignore[arg-type]
    try:
        _tiny_job(loop, "q", lambda step: _until(
            lambda: "job q's preview not stored: OSError: [Errno 28]" in caplog.text))
        report = loop.report()
        assert report.store_error is None and report.takes_jobs  # no store fault
        [done] = _collect(loop, 1)
        assert done.outcome == "succeeded" and done.video_key == "videos/q.mp4"
    finally:
        loop.close()


def test_only_a_leader_with_a_pipeline_that_previews_takes_previews(tiny_pipe: Any) -> None:
    class StillPipe(CountingPipe):
        can_preview = False

    cases = [(0, tiny_pipe, Layout(sp=2), 2, 2),  # the replica's leader
             (1, tiny_pipe, Layout(sp=2), 2, 0),  # its other rank
             (0, tiny_pipe, SOLO, 0, 0),  # previews off
             (0, StillPipe(), SOLO, 2, 0)]  # a pipeline that offers none
    for rank, pipe, layout, every, expected in cases:
        loop = RankLoop(rank, pipe, PreviewWrite(), PLATFORM,  # type: ignore[arg-type]
                        layout=layout, preview_every_steps=every)
        try:
            assert loop.preview_every_steps == expected
        finally:
            loop.close()

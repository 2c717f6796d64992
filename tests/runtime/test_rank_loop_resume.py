"""Ranks driven by a script, through the service's rank loop.

Two replicas of one rank each (dp=2, allgather): a replica that sits turns out, a job suspended in
place for another, and a job handed back with a checkpoint and resumed on the other replica all
render the frames of an uninterrupted render, bit for bit. One rank that finds checkpoints it must
not use (another model's, another request's, a truncated one, an older format's) says why and
renders each job from step 0."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from multirank import run_ranks
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from common.families import TINY_MODEL
from runtime.pipelines.base import VideoRequest
from runtime.platform import get_platform
from runtime.rank_loop import (
    Ended,
    Progress,
    RankLoop,
    RankMessage,
    StepPlan,
    Ticket,
    run_loop,
)
from runtime.render import frames_to_uint8, load_pipeline
from runtime.resume import model_fingerprint, snapshot
from runtime.sequence import Layout, open_sequence

REQUESTS = {
    "a": VideoRequest(prompt="a red circle moving left", width=64, height=64, num_frames=9,
                      num_inference_steps=8, seed=1),
    "b": VideoRequest(prompt="a blue square", width=64, height=64, num_frames=5,
                      num_inference_steps=6, seed=2),
    "c": VideoRequest(prompt="a green line", width=64, height=64, num_frames=5,
                      num_inference_steps=3, seed=3),
}
HAND_BACK_AT = 4  # steps of "a" before it is handed back


class DirCheckpoints:
    """`runtime.rank_loop.Checkpoints` in a directory every rank process sees."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def load(self, job_id: str) -> bytes | None:
        path = self.root / job_id
        return path.read_bytes() if path.exists() else None

    def save(self, job_id: str, blob: bytes) -> None:
        (self.root / job_id).write_bytes(blob)

    def delete(self, job_id: str) -> None:
        (self.root / job_id).unlink(missing_ok=True)


class Script:
    """Turn by turn: A on replica 0 and B on replica 1; replica 0 sits out three turns; C given
    to replica 1 (B suspended until C ends); A handed back at step HAND_BACK_AT and given to
    replica 1 once it is free; stops when every job is stored."""

    def __init__(self) -> None:
        self.turn = 0
        self.steps: dict[str, int] = {}
        self.stored: set[str] = set()
        self.messages: list[Progress | Ended] = []
        self.handed_back = self.reassigned = self.sent_c = False

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        pass

    def next_plan(self, stop_requested: bool) -> StepPlan:
        self.turn += 1
        if self.stored >= {"a", "b", "c"}:
            return StepPlan(stop=True)
        if self.turn == 1:
            return StepPlan(step=True, assign={
                0: Ticket(job_id="a", attempt_token="a1", request=REQUESTS["a"]),
                1: Ticket(job_id="b", attempt_token="b1", request=REQUESTS["b"])})
        plan = StepPlan(step=True)
        if 2 <= self.turn <= 4:
            plan.run = {1: "b"}  # replica 0 sits these turns out, holding A
        if self.steps.get("b", 0) >= 2 and not self.sent_c:
            self.sent_c = True
            plan.assign[1] = Ticket(job_id="c", attempt_token="c1", request=REQUESTS["c"])
        if self.steps.get("a", 0) >= HAND_BACK_AT and not self.handed_back:
            self.handed_back = True
            plan.hand_back = ["a"]
        elif self.handed_back and not self.reassigned and "b" in self.stored:
            self.reassigned = True
            plan.assign[1] = Ticket(job_id="a", attempt_token="a2", request=REQUESTS["a"])
        return plan

    def record(self, messages: list[RankMessage]) -> None:
        for m in messages:
            if isinstance(m, Progress | Ended):
                self.messages.append(m)
            if isinstance(m, Progress) and m.computed:
                self.steps[m.job_id] = m.step
            if isinstance(m, Ended) and m.outcome == "succeeded":
                self.stored.add(m.job_id)

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def _rank(rank: int, world: int, out: str) -> list[dict[str, Any]] | None:
    layout = Layout(dp=2, sp=1)
    platform = get_platform("cpu")
    pipe = load_pipeline(TINY_MODEL, device=platform.device, use_allgather=True,
                         sequence=open_sequence(layout, platform.backend))

    def write(frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        np.save(Path(out) / f"{job_id}.npy", frames)
        return f"{job_id}.mp4", f"{job_id}.png"

    checkpoints = Path(out) / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    loop = RankLoop(rank, pipe, write, platform, layout=layout,
                    checkpoints=DirCheckpoints(checkpoints), checkpoint_every_steps=100)
    script = Script() if rank == 0 else None
    run_loop(rank, world, loop, script)
    if script is None:
        return None
    return [{"job_id": m.job_id, "token": m.attempt_token, "step": m.step,
             "outcome": m.outcome if isinstance(m, Ended) else None,
             "computed": isinstance(m, Progress) and m.computed,
             "resumed_from_step": m.resumed_from_step if isinstance(m, Progress) else None}
            for m in script.messages]


def test_paused_suspended_and_resumed_jobs_render_the_frames_of_an_uninterrupted_render(
        tmp_path: Path) -> None:
    statuses = run_ranks(2, _rank, str(tmp_path), timeout=180)[0]
    pipe = load_pipeline(TINY_MODEL, device=torch.device("cpu"))
    torch.set_num_threads(1)
    for job_id, request in REQUESTS.items():
        expected = frames_to_uint8(pipe.generate(request)).numpy()
        np.testing.assert_array_equal(np.load(tmp_path / f"{job_id}.npy"), expected,
                                      err_msg=job_id)
    progress = [s for s in statuses if s["outcome"] is None]
    # A sat turns out without losing its place: its steps go 1, then on from where it was.
    a1 = [s["step"] for s in progress if s["token"] == "a1" and s["computed"]]
    assert a1 == list(range(1, len(a1) + 1)) and a1[-1] >= HAND_BACK_AT
    assert [s for s in progress if s["token"] == "a1" and not s["computed"]], "A never paused"
    # B was suspended while C ran on its replica, then went on.
    b_waiting = [s["step"] for s in progress if s["job_id"] == "b" and not s["computed"]]
    assert b_waiting and len(set(b_waiting)) == 1
    # A's second attempt resumed from its hand-back's checkpoint: no step computed twice.
    a2 = [s for s in progress if s["token"] == "a2"]
    assert a2 and {s["resumed_from_step"] for s in a2} == {a1[-1]}
    assert [s["step"] for s in a2 if s["computed"]][0] == a1[-1] + 1
    assert ("a", "cancelled") in [(s["job_id"], s["outcome"]) for s in statuses]
    assert not list((tmp_path / "checkpoints").iterdir()), "checkpoints outlive their jobs"


# Checkpoints a rank must refuse: each job finds one in the store when its replica takes it.
REFUSED_REQUEST = VideoRequest(prompt="a red circle moving left", width=64, height=64,
                               num_frames=5, num_inference_steps=6, seed=5)
REFUSALS = {
    "other-model": "model fingerprint differs",
    "other-request": "another request",
    "truncated": "truncated",
    "older-format": "written by format 'kiln-denoise-state/0'",
}


def _bad_checkpoints(pipe: Any, fingerprint: str) -> dict[str, bytes]:
    """One refused checkpoint per case, each taken two steps into a render as a worker would."""
    def two_steps_in(request: VideoRequest, model: str) -> bytes:
        state = pipe.prepare(request)
        for _ in range(2):
            pipe.step(state)
        return snapshot(pipe, state, model_fingerprint=model)

    good = two_steps_in(REFUSED_REQUEST, fingerprint)
    (size,) = struct.unpack("<Q", good[:8])
    metadata = json.loads(good[8:8 + size])["__metadata__"]
    older = save_tensors(load_tensors(good),
                         metadata={**metadata, "format": "kiln-denoise-state/0"})
    other = dataclasses.replace(REFUSED_REQUEST, seed=6)
    return {"other-model": two_steps_in(REFUSED_REQUEST, "another-model:0123"),
            "other-request": two_steps_in(other, fingerprint),
            "truncated": good[:len(good) // 2],
            "older-format": older}


class OneAfterAnother:
    """Each refusal case's job on the one replica, one after the other, until all are stored."""

    def __init__(self) -> None:
        self.queue = list(REFUSALS)
        self.messages: list[Progress | Ended] = []
        self.busy = False

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        pass

    def next_plan(self, stop_requested: bool) -> StepPlan:
        if self.busy:
            return StepPlan(step=True)
        if not self.queue:
            return StepPlan(stop=True)
        self.busy = True
        job_id = self.queue.pop(0)
        return StepPlan(step=True, assign={0: Ticket(job_id=job_id, attempt_token=f"{job_id}-2",
                                                     request=REFUSED_REQUEST)})

    def record(self, messages: list[RankMessage]) -> None:
        for m in messages:
            if isinstance(m, Progress | Ended):
                self.messages.append(m)
            if isinstance(m, Ended) and m.outcome == "succeeded":
                self.busy = False

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def _refusing_rank(rank: int, world: int, out: str) -> dict[str, Any]:
    platform = get_platform("cpu")
    pipe = load_pipeline(TINY_MODEL, device=platform.device)
    fingerprint = model_fingerprint(TINY_MODEL)
    checkpoints = DirCheckpoints(Path(out))
    for job_id, blob in _bad_checkpoints(pipe, fingerprint).items():
        checkpoints.save(job_id, blob)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("runtime.rank_loop").addHandler(Keep(logging.WARNING))

    def write(frames: Any, job_id: str, fps: int) -> tuple[str, str]:
        np.save(Path(out) / f"{job_id}.npy", frames)
        return f"{job_id}.mp4", f"{job_id}.png"

    loop = RankLoop(rank, pipe, write, platform, layout=Layout(dp=1, sp=1),
                    checkpoints=checkpoints, checkpoint_every_steps=100,
                    model_fingerprint=fingerprint)
    script = OneAfterAnother()
    run_loop(rank, world, loop, script)
    return {"warnings": warnings,
            "statuses": [(m.job_id, m.outcome if isinstance(m, Ended) else None, m.step,
                          m.resumed_from_step if isinstance(m, Progress) else None)
                         for m in script.messages]}


def test_a_rank_refuses_a_foreign_truncated_or_older_checkpoint_and_renders_from_step_0(
        tmp_path: Path) -> None:
    """Another model's, another request's, a truncated and an older format's checkpoint: the
    rank logs why it does not use each, and the job renders from step 0 to the right frames."""
    result = run_ranks(1, _refusing_rank, str(tmp_path), timeout=120)[0]
    pipe = load_pipeline(TINY_MODEL, device=torch.device("cpu"))
    torch.set_num_threads(1)
    expected = frames_to_uint8(pipe.generate(REFUSED_REQUEST)).numpy()
    for job_id, reason in REFUSALS.items():
        said = [w for w in result["warnings"] if f"job {job_id}'s checkpoint" in w]
        assert len(said) == 1 and reason in said[0] and "starts from step 0" in said[0], said
        mine = [s for s in result["statuses"] if s[0] == job_id]
        assert all(resumed is None for *_, resumed in mine), mine
        assert [step for _, outcome, step, _ in mine if outcome is None][0] == 1, mine
        assert mine[-1][1] == "succeeded"
        np.testing.assert_array_equal(np.load(tmp_path / f"{job_id}.npy"), expected,
                                      err_msg=job_id)
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".npy"], \
        "a refused checkpoint outlives its job"

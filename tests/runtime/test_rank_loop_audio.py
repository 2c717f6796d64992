"""A finished job's soundtrack on its way from the rank to the MP4: the leader decodes it with the
frames where the pipeline makes one and the job wants it, its writer thread writes it into the
video (`storage.video.OutputWriter`), and the job's final status says the video has sound."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import av
import pytest
import torch

from runtime.pipelines.base import DenoiseState, VideoRequest
from runtime.rank_loop import Ended, RankLoop, StepPlan, Ticket
from storage.outputs import LocalStore
from storage.video import OutputWriter, Soundtrack

RATE = 16_000
FPS = 8
PLATFORM = SimpleNamespace(mem_get_info=lambda: (1, 2), device="cpu", is_accelerator=False)


class Pipe:
    """One step a job, frames of grey, and (``sound``) a soundtrack of a 440 Hz tone."""

    handles: list[Any] = []
    last_step_figures: dict[str, int] = {}  # a step's counts (none here)

    def __init__(self, sound: bool) -> None:
        if sound:
            self.decode_audio = self._decode_audio

    def handles_needed(self, state: DenoiseState) -> list[bool]:
        return []

    def prepare(self, request: VideoRequest) -> DenoiseState:
        return DenoiseState(request=request, latents=torch.zeros(1), num_inference_steps=1)

    def step(self, state: DenoiseState, active: Any = None) -> None:
        state.step_index += 1

    def idle_step(self, active: Any = None) -> None:
        pass

    def decode(self, state: DenoiseState) -> torch.Tensor:
        return torch.full((state.request.num_frames, 16, 16, 3), 0.5)

    def _decode_audio(self, state: DenoiseState) -> tuple[torch.Tensor, int]:
        n = state.request.num_frames * RATE // FPS
        t = torch.arange(n) / RATE
        return torch.stack([0.5 * torch.sin(2 * torch.pi * 440 * t)] * 2), RATE

    def close(self) -> None:
        pass


class Recording(OutputWriter):
    """The worker's writer into a local store, recording the soundtrack each call was given."""

    def __init__(self, store: LocalStore) -> None:
        super().__init__(store)
        self.sounds: list[Soundtrack | None] = []

    def __call__(self, frames: Any, job_id: str, fps: int,
                 audio: Soundtrack | None = None) -> tuple[str, str]:
        self.sounds.append(audio)
        return super().__call__(frames, job_id, fps, audio)


def _render(pipe: Pipe, write: Recording, *, audio: bool) -> Ended:
    loop = RankLoop(0, pipe, write, PLATFORM)  # type: ignore[arg-type]
    try:
        ticket = Ticket(job_id="job1", attempt_token="t", audio=audio,
                        request=VideoRequest(prompt="a", seed=1, width=16, height=16,
                                             num_frames=9, fps=FPS))
        assert loop.apply(StepPlan(assign={0: ticket}, step=True)) == []
        assert loop.step() is not None  # rendered; its files are being stored
        loop.reported()
        ended: list[Ended] = []
        for _ in range(100):
            ended += loop.written(wait=0.1)
            if ended:
                break
        assert len(ended) == 1 and ended[0].outcome == "succeeded", ended
        return ended[0]
    finally:
        loop.close()


def _codecs(store: LocalStore, key: str) -> list[str]:
    path = store.local_path(key)
    assert path is not None
    with av.open(str(path)) as c:
        return [s.codec_context.name for s in c.streams]


@pytest.mark.parametrize(("sound", "wanted", "expected"), [
    (True, True, ["h264", "aac"]), (True, False, ["h264"]), (False, True, ["h264"])],
    ids=["makes-and-wants", "not-wanted", "no-sound"])
def test_the_soundtrack_reaches_the_mp4_and_the_final_status(tmp_path, sound, wanted, expected):
    store = LocalStore(tmp_path / "store")
    write = Recording(store)
    ended = _render(Pipe(sound), write, audio=wanted)
    assert ended.has_audio is (expected == ["h264", "aac"])
    assert ended.video_key is not None and _codecs(store, ended.video_key) == expected
    [given] = write.sounds
    if ended.has_audio:
        assert given is not None and given.sample_rate == RATE
        assert tuple(given.samples.shape) == (2, 9 * RATE // FPS)
    else:
        assert given is None

"""A soundtrack in the MP4: an AAC stream beside the H.264 one, starting with the first frame and
as long as the video; a file written without one is the video alone."""

from __future__ import annotations

import av
import numpy as np
import pytest

from storage import video

RATE = 32_000  # MiniMax-H3's audio VAE's rate
# AAC is lossy: two steady tones at 0.5 and 0.3 (RMS 0.29) come back at 128 kb/s within 0.074
# of each sample and 0.006 RMS (measured over 1.25 s; the first AAC frame is the worst, the
# encoder starts from silence). The bounds leave some room for another FFmpeg build.
AAC_MAX_ABS = 0.15
AAC_RMS = 0.015


def _frames(n=30, h=32, w=48):
    return np.random.default_rng(0).random((n, h, w, 3), dtype=np.float32)


def _tones(num_samples: int) -> np.ndarray:
    t = np.arange(num_samples) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * 440 * t),
                     0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)


def _streams(path):
    with av.open(str(path)) as c:
        return [(s.type, s.codec_context.name, s.start_time, float(s.duration * s.time_base))
                for s in c.streams]


@pytest.mark.parametrize("extra", [500, -3000], ids=["longer-is-cut", "shorter-is-padded"])
def test_a_soundtrack_is_an_aac_stream_as_long_as_the_video_that_decodes_to_its_samples(
        tmp_path, extra):
    fps, n = 24, 30  # 1.25 s, 40,000 samples
    written = _tones(40_000 + extra)
    path = video.write_video(_frames(n), tmp_path / "a.mp4", fps=fps,
                             audio=video.Soundtrack(written, RATE))
    (vtype, vcodec, vstart, vdur), (atype, acodec, astart, adur) = _streams(path)
    assert (vtype, vcodec, atype, acodec) == ("video", "h264", "audio", "aac")
    assert vstart == astart == 0
    assert abs(adur - vdur) < 1 / fps and vdur == pytest.approx(n / fps)
    back = video.read_audio(path)
    assert back.sample_rate == RATE and back.samples.shape == (2, 40_000)
    expected = video.fit_audio(video.Soundtrack(written, RATE), n, fps)
    assert expected.shape == (2, 40_000)
    diff = back.samples - expected
    assert np.abs(diff).max() < AAC_MAX_ABS and np.sqrt((diff ** 2).mean()) < AAC_RMS
    # In sync: shifted one sample either way, the sound matches worse.
    for shift in (1, -1):
        off = back.samples[:, 1000 + shift:39_000 + shift] - expected[:, 1000:39_000]
        assert np.sqrt((off ** 2).mean()) > 2 * np.sqrt((diff ** 2).mean())
    if extra < 0:  # the padding is silence
        assert np.abs(back.samples[:, 40_000 + extra + 1024:]).max() < 0.02
        assert np.abs(back.samples[:, :40_000 + extra - 1024]).max() > 0.45
    # The frames are the same as without sound, and the index still comes first.
    assert np.array_equal(video.read_video(path),
                          video.read_video(video.write_video(_frames(n), tmp_path / "v.mp4",
                                                             fps=fps)))
    data = path.read_bytes()
    assert data.index(b"moov") < data.index(b"mdat")


def test_a_mono_torch_soundtrack_at_another_frame_rate_fits_that_video(tmp_path):
    torch = pytest.importorskip("torch")
    fps, n = 16, 30  # 1.875 s: a sound of 1.25 s gets 0.625 s of silence
    samples = torch.from_numpy(_tones(40_000)[:1])
    path = video.write_video(_frames(n), tmp_path / "m.mp4", fps=fps,
                             audio=video.Soundtrack(samples, RATE))
    (_, _, _, vdur), (_, _, _, adur) = _streams(path)
    assert abs(adur - vdur) < 1 / fps
    back = video.read_audio(path)
    assert back.samples.shape == (1, 60_000)
    # Mono, the encoder's first frame of a tone that starts at full level is off by up to 0.43
    # (a click; stereo at 128 kb/s is not, see AAC_MAX_ABS); after it the tone is within 0.01.
    steady = back.samples[0, 2048:39_000] - samples[0, 2048:39_000].numpy()
    assert np.abs(steady).max() < AAC_MAX_ABS
    assert np.abs(back.samples[0, 41_024:]).max() < 0.02  # the silence after the sound


def test_without_a_soundtrack_the_file_is_the_video_alone_byte_for_byte(tmp_path):
    frames = _frames(9)
    path = video.write_video(frames, tmp_path / "a.mp4", fps=24, audio=None)
    assert [s[:2] for s in _streams(path)] == [("video", "h264")]
    assert path.read_bytes() == video.write_video(frames, tmp_path / "b.mp4", fps=24).read_bytes()
    with pytest.raises(ValueError, match="no audio stream"):
        video.read_audio(path)


def test_write_outputs_and_the_output_writer_pass_the_soundtrack_on(tmp_path):
    from storage.outputs import LocalStore, video_key

    sound = video.Soundtrack(_tones(40_000), RATE)
    mp4, _ = video.write_outputs(_frames(), tmp_path / "o" / "job.mp4", fps=24, audio=sound)
    assert [s[1] for s in _streams(mp4)] == ["h264", "aac"]
    store = LocalStore(tmp_path / "store")
    writer = video.OutputWriter(store, staging_dir=tmp_path)
    with_sound = writer(_frames(), "job1", 24, sound)
    without = writer(_frames(), "job2", 24)
    assert [s[1] for s in _streams(store.local_path(with_sound[0]))] == ["h264", "aac"]
    assert [s[1] for s in _streams(store.local_path(without[0]))] == ["h264"]
    assert with_sound[0] == video_key("job1")


def test_a_soundtrack_of_the_wrong_shape_is_refused_before_writing(tmp_path):
    for bad in (np.zeros(100, np.float32), np.zeros((3, 100), np.float32)):
        with pytest.raises(ValueError, match="1 or 2 channels"):
            video.write_video(_frames(), tmp_path / "a.mp4", audio=video.Soundtrack(bad, RATE))
    assert not (tmp_path / "a.mp4").exists()

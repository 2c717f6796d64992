"""The S3 output store against an S3-compatible server: moto's, started by the test on a free
port of 127.0.0.1 and reached over HTTP by boto3 and by a plain HTTP client, as MinIO or AWS
would be. Everything between the settings and the server is kiln's own code: `make_store`, the
ranks' `OutputWriter`, the API's redirect to a presigned URL and its delete."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3
import httpx
import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from moto.server import ThreadedMotoServer

from api.app import create_app
from common.settings import Settings
from storage import lifecycle, submission
from storage.outputs import LocalStore, S3Store, checkpoint_key, make_store, video_key
from storage.submission import JobSpec
from storage.tables import Job
from storage.users import create_api_key
from storage.video import OutputWriter, read_video
from tests.conftest import Database

REGION = "us-east-1"
ACCESS_KEY_ID = "kiln-test"
SECRET_ACCESS_KEY = secrets.token_hex(16)


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    """The endpoint URL of an S3 server in a thread of this process (port 0: a free one)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_url: str) -> str:
    """A bucket of its own for each test, made as an operator would before kiln uses it."""
    name = f"kiln-test-{secrets.token_hex(4)}"
    _client(s3_url).create_bucket(Bucket=name)
    return name


def _client(s3_url: str) -> Any:
    return boto3.client("s3", endpoint_url=s3_url, region_name=REGION,
                        aws_access_key_id=ACCESS_KEY_ID,
                        aws_secret_access_key=SECRET_ACCESS_KEY)


def _settings(tmp_path: Path, s3_url: str, bucket: str, **overrides: object) -> Settings:
    values: dict[str, object] = dict(
        storage_url=f"s3://{bucket}/renders", s3_endpoint_url=s3_url, s3_region=REGION,
        s3_access_key_id=ACCESS_KEY_ID, s3_secret_access_key=SECRET_ACCESS_KEY,
        output_dir=tmp_path / "unused-outputs", models=["kiln-tiny"],
        reconcile_interval_seconds=3600,
    )
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


def _frames() -> np.ndarray:
    """Nine 64x64 frames with a gradient, so the decoded video can be told from another."""
    ramp = np.linspace(0, 255, 64, dtype=np.uint8)
    frame = np.stack([np.tile(ramp, (64, 1)), np.tile(ramp[:, None], (1, 64)),
                      np.full((64, 64), 128, np.uint8)], axis=-1)
    return np.stack([frame] * 9)


def _expires_in(url: str) -> float:
    """Seconds a presigned URL stays valid: X-Amz-Expires in a SigV4 URL, Expires (a Unix
    time) in a SigV2 one, which botocore makes unless the client is set to s3v4."""
    query = parse_qs(urlsplit(url).query)
    if "X-Amz-Expires" in query:
        return float(query["X-Amz-Expires"][0])
    return float(query["Expires"][0]) - time.time()


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_s3_store_writes_serves_and_deletes_a_jobs_video_through_the_api_against_a_server(
    db: Database, redis_client: redis.Redis, redis_prefix: str, tmp_path: Path, s3_url: str,
    bucket: str,
) -> None:
    settings = _settings(tmp_path, s3_url, bucket, database_url=db.url,
                         redis_url="redis://unused", redis_prefix=redis_prefix,
                         url_expires_seconds=120)
    store = make_store(settings)
    assert isinstance(store, S3Store)
    with db.session() as s:
        alice = create_api_key(s, "alice")
        spec = JobSpec(model="kiln-tiny", prompt="p", width=64, height=64, num_frames=9, fps=8,
                       num_inference_steps=4, guidance_scale=5.0, seed=0)
        job_id = submission.create_job(s, alice.user, spec, request_hash="s3").job.id

    # Written as a rank writes it: encoded to MP4 and PNG, then put in the store.
    with db.session() as s:
        claim = lifecycle.claim_job(s, job_id, worker_group_id="test-group", rank=0,
                                    lease_seconds=60)
        assert claim is not None
        video, thumbnail = OutputWriter(store, staging_dir=tmp_path)(_frames(), job_id, fps=8)
        assert lifecycle.finish_succeeded(s, job_id, claim.attempt_token, video_key=video,
                                          thumbnail_key=thumbnail)
    names = sorted(o["Key"] for o in _client(s3_url).list_objects_v2(Bucket=bucket)["Contents"])
    assert names == [f"renders/thumbnails/{job_id}.png", f"renders/videos/{job_id}.mp4"]

    # Served: the API answers with a presigned URL of the server, which a client follows.
    app = create_app(settings, engine=db.engine, redis=redis_client)
    auth = {"Authorization": f"Bearer {alice.key}"}
    with TestClient(app) as api:
        answer = api.get(f"/v1/jobs/{job_id}/video", headers=auth, follow_redirects=False)
        assert answer.status_code == 307
        location = answer.headers["location"]
        assert location.startswith(f"{s3_url}/{bucket}/renders/videos/{job_id}.mp4?")
        assert 100 <= _expires_in(location) <= 120
        download = httpx.get(location)
        assert download.status_code == 200
        (tmp_path / "downloaded.mp4").write_bytes(download.content)
        decoded = read_video(tmp_path / "downloaded.mp4")
        assert decoded.shape == (9, 64, 64, 3)
        assert np.abs(decoded.astype(int) - _frames()).mean() < 4  # lossy, but this video

        # Deleted: the API removes the job's files from the bucket, and the link stops working.
        deleted = api.delete(f"/v1/videos/{job_id}", headers=auth)
        assert deleted.status_code == 200 and deleted.json()["id"] == job_id
        assert "Contents" not in _client(s3_url).list_objects_v2(Bucket=bucket)
        assert not store.exists(video_key(job_id))
        assert httpx.get(location).status_code == 404
        assert api.get(f"/v1/jobs/{job_id}/video", headers=auth).status_code == 404
    with db.session() as s:
        row = s.get(Job, job_id)
        assert row is not None and row.deleted_at is not None


def test_both_stores_list_a_folders_keys_and_nothing_else(
    tmp_path: Path, s3_url: str, bucket: str,
) -> None:
    """``keys``: the objects in one folder (the checkpoint clean-up lists its own), under the
    S3 store's prefix, without files still being written."""
    s3 = make_store(_settings(tmp_path, s3_url, bucket))
    for store in [LocalStore(tmp_path), s3]:
        for job_id in ("b" * 20, "a" * 20):
            store.put_bytes(checkpoint_key(job_id), b"state")
        store.put_bytes(video_key("c" * 20), b"video")
        assert store.keys("checkpoints") == [checkpoint_key("a" * 20), checkpoint_key("b" * 20)]
        assert store.keys("previews") == []
    (tmp_path / "checkpoints" / ".tmp-x.ckpt").write_bytes(b"half")
    assert len(LocalStore(tmp_path).keys("checkpoints")) == 2
    names = sorted(o["Key"] for o in _client(s3_url).list_objects_v2(Bucket=bucket)["Contents"])
    assert names == [f"renders/checkpoints/{'a' * 20}.ckpt",
                     f"renders/checkpoints/{'b' * 20}.ckpt", f"renders/videos/{'c' * 20}.mp4"]

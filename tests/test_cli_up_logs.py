"""One job followed through the logs of `kiln up`'s processes by its id: under ``kiln
--log-format json up`` the API's log has its submit, the worker's its claim, its steps, its
stored files and its end (each line with the rank), Celery's its webhook (Celery's own line
for the task too), every line a JSON object with a UTC timestamp."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Receiver, kiln_up

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _lines_of(log: Path, job_id: str) -> list[dict[str, Any]]:
    """The JSON lines of ``log`` that carry ``job_id`` (a log file also has lines that are not
    log records: kiln up's start marks, Celery's banner)."""
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("job") == job_id:
                found.append(record)
    return found


def _life(logs: Path, job_id: str) -> dict[str, list[str]]:
    """Each process's lines of the job, as ``logger rank message``."""
    return {name: [f"{r['logger']} {r.get('rank')} {r['msg']}" for r in
                   _lines_of(logs / f"{name}.log", job_id)]
            for name in ("api", "worker", "celery")}


def _followed(life: dict[str, list[str]]) -> bool:
    """Submit, claim, steps, store, end and webhook are all there."""
    text = {name: "\n".join(lines) for name, lines in life.items()}
    return ("api.jobs None submitted by" in text["api"]
            and all(f"{what}" in text["worker"] for what in (
                "kiln.coordinator 0 claimed", "runtime.rank_loop 0 taken: 2 steps",
                "runtime.rank_loop 0 step 1 of 2", "runtime.rank_loop 0 step 2 of 2",
                "runtime.rank_loop 0 stored: ", "kiln.coordinator 0 ended"))
            and "kiln.tasks None webhook job.succeeded delivered to 127.0.0.1:" in text["celery"]
            and "celery.app.trace None Task kiln.deliver_webhook[" in text["celery"])


@pytest.mark.chaos
def test_one_jobs_life_is_followed_by_its_id_through_every_process_log(tmp_path: Path) -> None:
    with Receiver() as receiver, kiln_up(tmp_path, "--dp", "1", celery=True,
                                         kiln_options=("--log-format", "json")) as (base, key):
        created = httpx.post(f"{base}/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                             timeout=30, json={"prompt": "a red circle moving left",
                                               "width": 64, "height": 64, "num_frames": 9,
                                               "num_inference_steps": 2, "seed": 7,
                                               "webhook_url": receiver.url})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        logs = tmp_path / "var" / "logs"
        deadline = time.monotonic() + 240  # the worker group loads its model meanwhile
        while not _followed(life := _life(logs, job_id)):
            assert time.monotonic() < deadline, life
            time.sleep(0.5)
    assert [r.headers["Kiln-Event"] for r in receiver.requests] == ["job.succeeded"]
    records = [r for name in ("api", "worker", "celery")
               for r in _lines_of(logs / f"{name}.log", job_id)]
    assert all(TIMESTAMP.match(r["ts"]) and r["level"] == "INFO" for r in records), records
    # The rank's lines carry the job's attempt too; the submit and the webhook have none.
    assert {r["attempt"] for r in records if r["process"] == "worker"} == {1}
    assert {r["process"] for r in records} == {"api", "worker", "celery"}
    for r in sorted(records, key=lambda r: r["ts"]):  # shown with -s
        print(r["ts"], r["process"], r["logger"], r["msg"])

"""kiln's one logging configuration (`common.logs`): a text or JSON line carries a UTC timestamp,
the level, the logger and whose work it is (rank, job, attempt, and the line's own fields), from
the process, a `bound` block or the line itself; Celery's worker logs through it, with the job of
the task it runs.

The whole configuration is applied only in child processes: `logging.config.dictConfig` closes
every handler of the process it runs in, pytest's own included."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common import logs

ROOT = Path(__file__).resolve().parents[2]
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<rest>.*)$")


def _logger(fmt: str, **process: int) -> tuple[logging.Logger, io.StringIO]:
    """A logger of its own writing to a string through the formatter `logs.config` names."""
    spec = dict(logs.config("INFO", fmt, process="worker", **process)["formatters"]["kiln"])
    formatter = spec.pop("()")(**spec)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.Logger("kiln.coordinator")
    logger.addHandler(handler)
    return logger, out


def _rest(line: str) -> str:
    """A text line after its timestamp (which it must start with)."""
    stamped = TEXT_LINE.match(line)
    assert stamped is not None, line
    return stamped["rest"]


def test_a_text_line_has_a_utc_timestamp_level_logger_then_rank_job_and_attempt() -> None:
    log, out = _logger("text", rank=1)
    with logs.bound(job="j1", attempt=2):
        log.info("claimed", extra=logs.fields(replica=1, why="a b", error=None))
    log.warning("no job here")
    first, second = out.getvalue().splitlines()
    assert _rest(first) == 'INFO kiln.coordinator rank=1 job=j1 attempt=2 claimed replica=1 ' \
                           'why="a b"'
    assert _rest(second) == "WARNING kiln.coordinator rank=1 no job here"


def test_a_json_line_is_one_object_with_the_same_fields() -> None:
    log, out = _logger("json", rank=0)
    with logs.bound(job="j1", attempt=1):
        log.info("step %d of %d", 3, 20, extra=logs.fields(msg="not the message"))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("stored?", extra=logs.fields(job="j2"))
    step, failed = (json.loads(line) for line in out.getvalue().splitlines())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", step.pop("ts"))
    assert step == {"level": "INFO", "logger": "kiln.coordinator", "process": "worker",
                    "msg": "step 3 of 20", "rank": 0, "job": "j1", "attempt": 1}
    assert failed["job"] == "j2" and "attempt" not in failed
    assert failed["exc"].startswith("Traceback") and "RuntimeError: boom" in failed["exc"]


def test_bound_fields_last_for_their_block_in_their_thread_and_the_line_wins() -> None:
    log, out = _logger("text")
    with logs.bound(job="outer", attempt=1):
        with logs.bound(job="inner"):
            log.info("nested")
            thread = threading.Thread(target=log.info, args=("in a thread",))
            thread.start()
            thread.join()
        log.info("back", extra=logs.fields(attempt=3))
    log.info("after")
    lines = [_rest(line) for line in out.getvalue().splitlines()]
    assert lines == ["INFO kiln.coordinator job=inner attempt=1 nested",
                     "INFO kiln.coordinator in a thread",
                     "INFO kiln.coordinator job=outer attempt=3 back",
                     "INFO kiln.coordinator after"]


def test_bound_fields_stay_in_their_asyncio_task() -> None:
    log, out = _logger("text")

    async def handle(job_id: str) -> None:
        with logs.bound(job=job_id):
            await asyncio.sleep(0)  # the other request runs meanwhile
            log.info("submitted")

    async def serve() -> None:
        await asyncio.gather(handle("j1"), handle("j2"))
        log.info("served")

    asyncio.run(serve())
    assert [_rest(line) for line in out.getvalue().splitlines()] == [
        "INFO kiln.coordinator job=j1 submitted", "INFO kiln.coordinator job=j2 submitted",
        "INFO kiln.coordinator served"]


def test_an_unknown_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        logs.config("INFO", "xml", process="api")
    with pytest.raises(ValueError, match="log level"):
        logs.config("LOUD", "text", process="api")


def _run(code: str) -> list[str]:
    """The stderr lines of ``code`` run by a Python of its own, on the default log settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_LOG_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stderr.splitlines()


def test_configure_keeps_the_loggers_made_before_it_and_quiets_chatty_libraries() -> None:
    lines = _run("import logging\n"
                 "early = logging.getLogger('kiln.worker')\n"
                 "from common import logs\n"
                 "logs.configure('INFO', 'text', process='worker', rank=3)\n"
                 "early.info('launcher line')\n"
                 "logging.getLogger('httpx').info('HTTP Request: POST http://h/?token=t')\n"
                 "logging.getLogger('alembic.runtime.plugins').info('setup plugin')\n"
                 "logging.getLogger('uvicorn.error').info('Started server process')\n")
    assert [_rest(line) for line in lines] == [
        "INFO kiln.worker rank=3 launcher line", "INFO uvicorn.error rank=3 Started server process"]


def test_celery_logs_through_kilns_configuration_with_the_job_of_the_running_task() -> None:
    lines = _run("import logging\n"
                 "from celery import signals\n"
                 "from common.settings import get_settings\n"
                 "from kiln.tasks import make_celery\n"
                 "app = make_celery(get_settings())\n"
                 "deliver_webhook = app.tasks['kiln.deliver_webhook']\n"
                 "app.log.setup(loglevel='INFO')\n"
                 "assert len(logging.getLogger().handlers) == 1\n"
                 "logging.getLogger('celery.worker.strategy').info('Task received')\n"
                 "signals.task_prerun.send(deliver_webhook, task_id='t1', "
                 "task=deliver_webhook, args=('j1',))\n"
                 "logging.getLogger('kiln.tasks').info('webhook delivered')\n"
                 "logging.getLogger('kiln.tasks').debug('not shown')\n"
                 "logging.getLogger('celery.app.trace').info('Task succeeded')\n"
                 "signals.task_postrun.send(deliver_webhook, task_id='t1', "
                 "task=deliver_webhook)\n"
                 "logging.getLogger('celery.app.trace').info('after it')\n")
    assert [_rest(line) for line in lines] == [
        "INFO celery.worker.strategy Task received",
        "INFO kiln.tasks job=j1 webhook delivered",
        "INFO celery.app.trace job=j1 Task succeeded",
        "INFO celery.app.trace after it"]

"""One logging configuration for every kiln process (`kiln api`, `kiln worker` and each of its
ranks, Celery, `kiln up`), so that one job can be followed through all of them by its id.

Every line starts with a UTC timestamp, the level and the logger, then the fields that say whose
work it is: the rank (in a worker group), the job and its attempt; the line's other fields follow
its message::

    2026-12-03T14:00:00.123Z INFO kiln.coordinator rank=0 job=j1 attempt=1 claimed replica=1

With the ``json`` format (``--log-format json``, ``KILN_LOG_FORMAT=json``) each line is one JSON
object instead, for a log shipper: ``ts``, ``level``, ``logger``, ``process``, ``msg``, then the
fields.

The fields come from three places, later ones winning: the process (`configure`'s ``rank``),
what the code is doing (`bound`: a job's fields on every line logged inside it, in this thread or
asyncio task), and the line itself (``log.info(..., extra=fields(...))``). Call sites never write
``key=value`` themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

FORMATS = ("text", "json")
# The fields a text line shows before its message, in this order (the others follow it).
LEADING = ("rank", "job", "attempt")
# Libraries whose INFO lines are no operator's: httpx's name every URL fetched (a webhook's URL
# may carry its receiver's token in its query), alembic's every plugin it sets up at each start
# of `kiln up`. Only their warnings are shown.
QUIET = ("httpx", "httpcore", "alembic")
# uvicorn's loggers: no handlers of their own, their lines go through the root's like kiln's.
UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")

# Where `fields` puts a line's own fields on its LogRecord.
_RECORD_FIELDS = "kiln_fields"

# `bound` sets a new mapping and puts the old one back; none is changed in place.
_bound: ContextVar[Mapping[str, object]] = ContextVar("kiln_log_fields",
                                                      default=MappingProxyType({}))


def _present(fields: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in fields.items() if v is not None}


@contextlib.contextmanager
def bound(**fields: object) -> Iterator[None]:
    """Every line logged inside carries ``fields`` (None ones left out), in this thread or
    asyncio task only: a thread started inside binds its own."""
    token = _bound.set({**_bound.get(), **_present(fields)})
    try:
        yield
    finally:
        _bound.reset(token)


def fields(**fields: object) -> dict[str, Any]:
    """``extra=`` for one line: the fields of its own (None ones left out)."""
    return {_RECORD_FIELDS: _present(fields)}


def utc_timestamp(created: float) -> str:
    """``2026-12-03T14:00:00.123Z``: ISO 8601, UTC, milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + \
        f".{int(created % 1 * 1000):03d}Z"


class _Formatter(logging.Formatter):
    """What both formats share: the process's own fields, and the merge of the three places."""

    def __init__(self, process: str = "", rank: int | None = None) -> None:
        super().__init__()
        self.process = process
        self.process_fields = _present({"rank": rank})

    def fields_of(self, record: logging.LogRecord) -> dict[str, object]:
        # Read here, in the thread that logs: kiln's handlers write as the line is logged.
        return {**self.process_fields, **_bound.get(), **getattr(record, _RECORD_FIELDS, {})}

    def trailer(self, record: logging.LogRecord) -> str:
        """The record's traceback and stack, if it has them."""
        parts = []
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            parts.append(record.exc_text)
        if record.stack_info:
            parts.append(self.formatStack(record.stack_info))
        return "\n".join(parts)


def _text_value(value: object) -> str:
    text = str(value)
    if not text or any(c.isspace() or c in "\"=" for c in text):
        return json.dumps(text)
    return text


class TextFormatter(_Formatter):
    """``<timestamp> <level> <logger> rank=.. job=.. attempt=.. <message> <other fields>``."""

    def format(self, record: logging.LogRecord) -> str:
        found = self.fields_of(record)
        parts = [utc_timestamp(record.created), record.levelname, record.name]
        parts += [f"{k}={_text_value(found[k])}" for k in LEADING if k in found]
        parts.append(record.getMessage())
        parts += [f"{k}={_text_value(v)}" for k, v in found.items() if k not in LEADING]
        trailer = self.trailer(record)
        return " ".join(parts) + (f"\n{trailer}" if trailer else "")


class JsonFormatter(_Formatter):
    """One JSON object per line; a traceback is its ``exc`` string, not lines of its own."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {"ts": utc_timestamp(record.created),
                                   "level": record.levelname, "logger": record.name,
                                   "process": self.process, "msg": record.getMessage()}
        for key, value in self.fields_of(record).items():
            line.setdefault(key, value)  # a field never hides the line's own keys
        trailer = self.trailer(record)
        if trailer:
            line["exc"] = trailer
        return json.dumps(line, default=str)


def config(level: str = "INFO", fmt: str = "text", *, process: str,
           rank: int | None = None) -> dict[str, Any]:
    """The `logging.config.dictConfig` configuration: every line, kiln's, uvicorn's and
    Celery's, through one handler on stderr in format ``fmt`` at ``level`` and up.
    ``process`` names the process in JSON lines (api, worker, celery, up)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    level = level.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"unknown log level {level!r}")
    formatter = TextFormatter if fmt == "text" else JsonFormatter
    return {
        "version": 1,
        # Loggers made at import (``logging.getLogger(__name__)``) keep working.
        "disable_existing_loggers": False,
        "formatters": {"kiln": {"()": formatter, "process": process, "rank": rank}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "kiln",
                                "stream": "ext://sys.stderr"}},
        "loggers": {
            **{name: {"level": "WARNING"} for name in QUIET},
            **{name: {"level": level, "handlers": [], "propagate": True} for name in UVICORN},
        },
        "root": {"level": level, "handlers": ["stderr"]},
    }


def configure(level: str = "INFO", fmt: str = "text", *, process: str,
              rank: int | None = None) -> None:
    """Configures this process's logging (`config`); a process started with ``spawn`` (a rank)
    inherits none of it and calls this again."""
    logging.config.dictConfig(config(level, fmt, process=process, rank=rank))

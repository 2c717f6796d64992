"""The values the batcher keeps in Redis, each a JSON object with named fields.

This module is the only Python that encodes or decodes them; the Lua scripts
(``scheduler/lua/*.lua``) read the same records with ``cjson.decode`` by the same field names
(``m.owner``, ``m.job_class``, ...), and never write one: Python encodes every record and a
script stores the string it is given. A test holds the names the scripts read to the fields
declared here.

- `JobMeta`: ``P sched:job``, job id -> what the policy needs without a database read, and where
  the scripts find the job's queue keys. Its fields are `QueuedJob`'s, less the job id (the hash
  field) and the due time (the score of the job's sorted-set entries).
- `ChargeRecord`: ``P sched:charge:{job id}``, a started job's charge until
  `scheduler.claim.record_result` replaces it by the real render seconds.
- The learned costs, ``P sched:cost``: `CostModel`'s state, a mapping of named fits
  (`encode_costs`, `decode_costs`).

`FORMAT` names the encoding of these records; `scheduler.queue_index` stores it in its
``sched:built`` marker, so an index written in another format is cleared and rebuilt from the
database rather than misread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, Self

from scheduler.cost import CostModel
from scheduler.policy import QueuedJob

# Raise it whenever the encoding of `JobMeta` or `ChargeRecord` changes. Format "1" stored both
# as positional JSON lists.
FORMAT = "2"


class RecordError(ValueError):
    """A stored value that is not a record of the expected kind in the current format."""


class _Record:
    """JSON object encoding for a frozen dataclass: one key per field, no other."""

    __slots__ = ()

    def encode(self) -> str:
        return json.dumps(self._as_dict(), separators=(",", ":"))

    def _as_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: that deep-copies every value, several times slower, and a
        # rebuild of the index encodes one record per queued job.
        return {name: getattr(self, name) for name in field_names(type(self))}

    @classmethod
    def decode(cls, raw: str | bytes) -> Self:
        return cls(**cls._fields(raw))

    @classmethod
    def _fields(cls, raw: str | bytes) -> dict[str, Any]:
        """The stored fields, checked to be exactly the record's."""
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise RecordError(f"{cls.__name__}: not JSON: {raw!r}") from exc
        names = field_names(cls)
        if not (isinstance(value, dict) and len(value) == len(names)
                and all(name in value for name in names)):
            raise RecordError(f"{cls.__name__}: want an object with {sorted(names)}, "
                              f"got {raw!r}")
        return value


def _field_names(record: type) -> tuple[str, ...]:
    """A record's field names, as stored and as the Lua scripts read them."""
    return tuple(f.name for f in fields(record))


# Typed as a plain callable: mypy takes a class passed to cache's wrapper for unhashable.
field_names: Callable[[type], tuple[str, ...]] = cache(_field_names)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobMeta(_Record):
    """``P sched:job`` entry: a queued job's scheduling fields (see `QueuedJob`)."""

    owner: str
    model: str
    job_class: str
    priority: int
    num_tokens: int
    num_inference_steps: int
    deadline: float | None

    @classmethod
    def of(cls, job: QueuedJob) -> JobMeta:
        return cls(owner=job.owner, model=job.model, job_class=job.job_class,
                   priority=job.priority, num_tokens=job.num_tokens,
                   num_inference_steps=job.num_inference_steps, deadline=job.deadline)

    @classmethod
    def queued_job(cls, raw: str | bytes, *, job_id: str, due: float) -> QueuedJob:
        """The `QueuedJob` a stored meta describes, decoded straight into it (a claim reads a
        dozen; no `JobMeta` in between halves the time)."""
        return QueuedJob(job_id=job_id, due=due, **cls._fields(raw))


@dataclass(frozen=True, slots=True, kw_only=True)
class ChargeRecord(_Record):
    """``P sched:charge:{job id}``: what a started job was charged to its user, in its class."""

    owner: str
    job_class: str
    charged_seconds: float  # the estimate added to the user's service at the start
    cost_per_step: float  # the estimated seconds per step it was charged at

    @classmethod
    def of(cls, *, owner: str, job_class: str, cost_per_step: float,
           num_inference_steps: int) -> ChargeRecord:
        """The charge of a job started at an estimated ``cost_per_step`` seconds per step."""
        return cls(owner=owner, job_class=job_class,
                   charged_seconds=cost_per_step * num_inference_steps,
                   cost_per_step=cost_per_step)


def encode_costs(costs: CostModel) -> str:
    return json.dumps(costs.to_state())


def decode_costs(raw: str | bytes, **kwargs: Any) -> CostModel:
    """The `CostModel` ``encode_costs`` stored; ``kwargs`` as for `CostModel.from_state`
    (``sp``: the layout read)."""
    return CostModel.from_state(json.loads(raw), **kwargs)

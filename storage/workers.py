"""Worker groups as they report themselves: registration, periodic reports, listing."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.tables import WorkerGroup, utcnow


@dataclass(kw_only=True, slots=True)
class GroupReport:
    """What a worker group says about itself; rank 0 sends it at start and then periodically."""

    id: str  # stable for the life of the group process, e.g. f"{host}-{pid}-{random}"
    name: str
    host: str
    model: str
    mode: str  # "allgather" | "rank_local"
    platform: str  # "cuda" | "npu" | "cpu"
    dp_size: int
    world_size: int
    goal: str | None = None  # "latency" | "throughput": the class of jobs it takes first
    plan: dict[str, Any] | None = None  # --layout auto: the chosen layout and the runner-up
    state: str = "ready"  # "starting" | "ready" | "degraded" | "stopping" | "stopped"
    reason: str | None = None  # why, when degraded (a server out, say)
    # Per rank: rank, device, device_mem_used_bytes, device_mem_total_bytes, host_mem_bytes, job_id
    ranks: list[dict[str, Any]] = field(default_factory=list)


def report_group(session: Session, report: GroupReport, *, now: datetime | None = None) -> None:
    """Inserts or refreshes the group's row; commits."""
    now = now or utcnow()
    group = session.get(WorkerGroup, report.id)
    if group is None:
        group = WorkerGroup(id=report.id, started_at=now)
        session.add(group)
    group.name, group.host, group.model = report.name, report.host, report.model
    group.mode, group.platform, group.state = report.mode, report.platform, report.state
    group.state_reason, group.goal, group.plan = report.reason, report.goal, report.plan
    group.dp_size, group.world_size = report.dp_size, report.world_size
    group.ranks = list(report.ranks)
    group.heartbeat_at = now
    session.commit()


def list_groups(
    session: Session, *, stale_after_seconds: float, now: datetime | None = None,
    include_stopped: bool = False,
) -> list[tuple[WorkerGroup, bool]]:
    """(group, is_stale) for every group, newest first; stopped groups only on request."""
    now = now or utcnow()
    query = select(WorkerGroup).order_by(WorkerGroup.started_at.desc())
    if not include_stopped:
        query = query.where(WorkerGroup.state != "stopped")
    cutoff = now - timedelta(seconds=stale_after_seconds)
    return [(g, g.heartbeat_at < cutoff) for g in session.scalars(query)]


def mark_stopped(session: Session, group_id: str, *, reason: str | None = None,
                 now: datetime | None = None) -> None:
    """A group that can no longer report itself (its ranks died) is stopped, with the reason;
    commits. Nothing for a group never reported."""
    group = session.get(WorkerGroup, group_id)
    if group is None:
        return
    group.state, group.state_reason = "stopped", reason
    group.heartbeat_at = now or utcnow()
    session.commit()


def group_names(session: Session, group_ids: list[str]) -> dict[str, str]:
    """The names of the groups among ``group_ids`` that are known (stopped ones included)."""
    if not group_ids:
        return {}
    rows = session.execute(select(WorkerGroup.id, WorkerGroup.name)
                           .where(WorkerGroup.id.in_(group_ids)))
    return {group_id: name for group_id, name in rows}

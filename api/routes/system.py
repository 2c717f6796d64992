"""Worker groups, health, readiness and Prometheus metrics."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis import RedisError
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

import migrations
from api.deps import CurrentUser, SessionDep, SettingsDep
from api.errors import error_body
from api.schemas import RankPublic, ReplicaPublic, WorkerGroupList, WorkerGroupPublic
from storage import queries, workers

router = APIRouter(tags=["system"])


@router.get("/v1/workers", response_model=WorkerGroupList)
def list_workers(user: CurrentUser, session: SessionDep,
                 settings: SettingsDep) -> WorkerGroupList:
    """Worker groups with their ranks, memory and current jobs (only jobs the caller may see)."""
    groups = workers.list_groups(session, stale_after_seconds=settings.worker_stale_seconds)
    running = queries.running_jobs_by_group(session, [g.id for g, _ in groups])
    data = []
    for group, stale in groups:
        mine = {j.id: j for j in running.get(group.id, [])
                if user.is_admin or j.owner_id == user.id}
        ranks = []
        for entry in group.ranks:
            fields = {k: entry.get(k) for k in RankPublic.model_fields}
            job = mine.get(fields.get("job_id") or "")
            fields["job_id"] = job.id if job else None
            if job is not None:
                fields["step"] = job.progress_step
                fields["total_steps"] = job.progress_total or job.num_inference_steps
            ranks.append(RankPublic.model_validate(fields))
        pss = [r.host_mem_bytes for r in ranks if r.host_mem_bytes is not None]
        sp = max(1, group.world_size // max(1, group.dp_size))
        replicas = [ReplicaPublic(replica=i, ranks=list(range(i * sp, (i + 1) * sp)))
                    for i in range(group.dp_size)]
        for r in ranks:
            if r.rank % sp == 0 and r.rank // sp < len(replicas):
                replicas[r.rank // sp].job_id = r.job_id
        data.append(WorkerGroupPublic(
            id=group.id, name=group.name, host=group.host, model=group.model, mode=group.mode,
            platform=group.platform, dp_size=group.dp_size, sp_size=sp, goal=group.goal,
            plan=group.plan, world_size=group.world_size, replicas=replicas,
            state=group.state, reason=group.state_reason, stale=stale,
            started_at=group.started_at,
            heartbeat_at=group.heartbeat_at, ranks=ranks, host_mem_bytes=sum(pss) if pss else None,
            num_running=len(running.get(group.id, [])), current_jobs=sorted(mine),
        ))
    return WorkerGroupList(data=data)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (no dependencies checked). Answered on the event loop, so it stays
    quick while every worker thread waits on a database or Redis that is down."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "A dependency is unreachable"}})
def readyz(request: Request, session: SessionDep, settings: SettingsDep) -> Response:
    """Database reachable and migrated, Redis reachable; a 503 says which is not, in its
    ``detail`` and in ``checks`` (``"ok"`` or what is wrong, per dependency)."""
    checks = {"database": "ok", "redis": "ok"}
    try:
        version = session.execute(text("SELECT version_num FROM alembic_version")).scalar()
        if (version,) != migrations.current_heads():
            checks["database"] = (f"schema at {version}, not the latest; "
                                  "run kiln db upgrade")
    except SQLAlchemyError as exc:
        checks["database"] = f"unreachable ({type(exc).__name__})"
    finally:
        session.rollback()
    try:
        request.app.state.redis.ping()
    except RedisError as exc:
        checks["redis"] = f"unreachable ({type(exc).__name__})"
    problems = [f"{name}: {state}" for name, state in checks.items() if state != "ok"]
    if problems:
        return JSONResponse(
            error_body(503, "; ".join(problems), code="not_ready", checks=checks),
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": str(settings.unavailable_retry_after_seconds)})
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response,
            responses={401: {"description": "KILN_METRICS_TOKEN is set and was not sent"}})
def metrics(request: Request, settings: SettingsDep) -> Response:
    """Prometheus metrics. With ``KILN_METRICS_TOKEN`` set, only for ``Authorization: Bearer
    <token>`` (the counts are the whole deployment's, beside the host's memory and the worker
    groups' ids and memory); unset, open to whoever reaches the port."""
    if settings.metrics_token is not None:
        scheme, _, sent = request.headers.get("authorization", "").partition(" ")
        expected = settings.metrics_token.get_secret_value()
        # Compared in constant time: how long a wrong token takes says nothing of the right one.
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(),
                                                                 expected.encode()):
            return JSONResponse(
                error_body(401, "GET /metrics needs Authorization: Bearer <KILN_METRICS_TOKEN>",
                           code="invalid_metrics_token"),
                status_code=status.HTTP_401_UNAUTHORIZED,
                headers={"WWW-Authenticate": 'Bearer realm="kiln metrics"'})
    return Response(generate_latest(request.app.state.registry),
                    media_type=CONTENT_TYPE_LATEST)

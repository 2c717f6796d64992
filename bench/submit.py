"""Submit throughput: N concurrent clients POST /v1/jobs; submits per second and latency.

Against a running API (the jobs stay queued; use a throwaway database and a high
KILN_MAX_QUEUED_JOBS_PER_USER):

    python bench/submit.py --url http://127.0.0.1:8000 --key "$KEY" --clients 50 --requests 5000

Or let it start everything: a fresh PostgreSQL (or SQLite) database, migrated and dropped at the
end, and ``kiln api --workers N`` on a free port, optionally pinned to CPUs:

    python bench/submit.py --spawn --api-workers 2 --repeat 3 [--api-cpus 0,1] [--cpus 1]

Prints JSON: submits/s, p50/p90/p99 latency, failures, and the CPU seconds per submit that the
load generator, the API processes and the rest of the machine (database, Redis, anything else
running) spent, so a figure can be read against what the machine had to give.

The clients speak HTTP/1.1 over keep-alive sockets with a pre-encoded request: a full HTTP
client costs about as much CPU per request as the API's own parsing, and on a small machine the
load generator would otherwise take the cores it is meant to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BODY = {"width": 64, "height": 64, "num_frames": 9, "num_inference_steps": 4, "class": "batch"}


def _request(host: str, key: str, i: int, kind: str = "submit") -> bytes:
    if kind == "healthz":  # the floor: HTTP, the middleware stack, one thread-pool hop
        return f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    body = json.dumps({"prompt": f"bench prompt {i}", **BODY}).encode()
    return (f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    request: bytes) -> int:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def load(url: str, key: str, num_clients: int, num_requests: int,
               kind: str = "submit") -> dict[str, Any]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    latencies: list[float] = []
    failures: dict[str, int] = {}
    todo = iter(range(num_requests))

    async def one_client() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for i in todo:
                request = _request(f"{host}:{port}", key, i, kind)
                start = time.perf_counter()
                try:
                    status = await _exchange(reader, writer, request)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                    continue
                if status == (201 if kind == "submit" else 200):
                    latencies.append(time.perf_counter() - start)
                else:
                    failures[str(status)] = failures.get(str(status), 0) + 1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    began = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(num_clients)))
    elapsed = time.perf_counter() - began
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [0.0] * 99
    return {"submits": len(latencies), "seconds": round(elapsed, 2),
            "submits_per_s": round(len(latencies) / elapsed, 1),
            "p50_ms": round(q[49] * 1e3, 1), "p90_ms": round(q[89] * 1e3, 1),
            "p99_ms": round(q[98] * 1e3, 1), "failures": failures}


def _tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its live children."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    except psutil.Error:
        pass
    return total


def _matching_cpu(needle: str) -> dict[int, float]:
    """CPU seconds by pid of every process whose command line contains ``needle`` (a PostgreSQL
    backend's title names its database; the Redis server's names its port)."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if needle in " ".join(p.info["cmdline"] or []):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
    return out


def measure(url: str, key: str, args: argparse.Namespace, api_pid: int | None,
            db_name: str | None, kind: str = "submit") -> dict[str, Any]:
    def sample() -> dict[str, Any]:
        t = psutil.cpu_times()
        out: dict[str, Any] = {
            "machine": sum(getattr(t, f) for f in ("user", "system", "nice", "irq", "softirq")),
            "load_generator": time.process_time(),
            "redis_server": _matching_cpu(f":{urlsplit(args.redis_url).port or 6379}")}
        if api_pid is not None:
            out["api"] = _tree_cpu(api_pid)
        if db_name is not None:
            out["database"] = _matching_cpu(f" {db_name} ")
        return out

    def spent(before: Any, after: Any) -> float:
        if isinstance(before, float):
            return after - before
        # Per process: one that started meanwhile counts whole; one that ended is missed (the
        # API's pool keeps its connections, so few do).
        return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())

    before = sample()
    result = asyncio.run(load(url, key, args.clients, args.requests, kind))
    after = sample()
    n = max(result["submits"], 1)
    cpu = {k: spent(before[k], after[k]) for k in before}
    # The rest: other work on the machine (the Redis server serves other clients too).
    cpu["rest"] = cpu["machine"] - sum(v for k, v in cpu.items() if k != "machine")
    result["cpu_ms_per_submit"] = {k: round(1e3 * v / n, 2) for k, v in cpu.items()}
    result["cores_used"] = {k: round(v / result["seconds"], 2) for k, v in cpu.items()}
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return result


@contextlib.contextmanager
def spawned_api(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[str, str, int, str]]:
    """A fresh database and ``kiln api --workers N``: (url, key, pid of the API, database)."""
    import secrets

    import redis
    from sqlalchemy.engine import make_url

    from bench.service_latency import KILN, fresh_database, make_key, process, wait_healthy
    from common.procs import free_port

    prefix = f"kiln-bench-{secrets.token_hex(3)}:"
    with fresh_database(args.backend, tmp) as db_url:
        key = make_key(db_url)
        port = free_port()
        env = {**os.environ, "KILN_DATABASE_URL": db_url, "REDIS_URL": args.redis_url,
               "KILN_REDIS_PREFIX": prefix, "KILN_OUTPUT_DIR": str(tmp / "outputs"),
               "KILN_MAX_QUEUED_JOBS_PER_USER": "10000000", "KILN_ENVIRONMENT": "local"}
        argv = [KILN, "api", "--port", str(port), "--workers", str(args.api_workers)]
        if args.api_cpus:
            argv = ["taskset", "-c", args.api_cpus, *argv]
        try:
            with process(argv, env) as proc:
                url = f"http://127.0.0.1:{port}"
                wait_healthy(url)
                yield url, key, proc.pid, make_url(db_url).database or ""
        finally:
            r = redis.Redis.from_url(args.redis_url)
            try:
                keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
                for start in range(0, len(keys), 1000):
                    r.delete(*keys[start:start + 1000])
            finally:
                r.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", help="an API key (kiln keys create --user bench)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=1, help="runs after one warm-up run")
    parser.add_argument("--spawn", action="store_true",
                        help="start a fresh database and kiln api instead of using --url")
    parser.add_argument("--backend", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--api-workers", type=int, default=2)
    parser.add_argument("--api-cpus", default="", help="taskset CPU list for the API")
    parser.add_argument("--cpus", default="", help="taskset CPU list for this load generator")
    parser.add_argument("--floor", action="store_true",
                        help="also time GET /healthz the same way: the API's cost per request "
                             "before any database or Redis work")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL",
                                                               "redis://127.0.0.1:6379/0"))
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    with contextlib.ExitStack() as stack:
        api_pid = db_name = None
        url, key = args.url, args.key
        if args.spawn:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-bench-")))
            url, key, api_pid, db_name = stack.enter_context(spawned_api(args, tmp))
            if args.backend == "sqlite":
                db_name = None  # in the API's own processes
        if not key:
            parser.error("--key is required without --spawn")
        # A short warm-up: connection pools, the key cache, first-request imports.
        asyncio.run(load(url, key, args.clients, min(args.requests, 500)))
        runs = [measure(url, key, args, api_pid, db_name) for _ in range(args.repeat)]
        floor = measure(url, key, args, api_pid, db_name, "healthz") if args.floor else None
    rates = [r["submits_per_s"] for r in runs]
    print(json.dumps({
        "clients": args.clients, "requests": args.requests,
        "api_workers": args.api_workers if args.spawn else None, "backend": args.backend,
        "api_cpus": args.api_cpus or "any", "load_generator_cpus": args.cpus or "any",
        "submits_per_s": {"median": statistics.median(rates), "min": min(rates),
                          "max": max(rates)},
        "runs": runs, "healthz_floor": floor}, indent=2))


if __name__ == "__main__":
    main()

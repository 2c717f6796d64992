"""Submit throughput: N concurrent clients POST /v1/jobs against a running kiln API.

    kiln api --workers 2 &                  # against PostgreSQL: DATABASE_URL=postgresql+psycopg://...
    python bench/submit.py --key "$KEY" --clients 50 --requests 5000

Prints submits per second and latency percentiles. The jobs stay queued (no worker needed); use a
throwaway database and a high KILN_MAX_QUEUED_JOBS_PER_USER.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx


async def run(url: str, key: str, num_clients: int, num_requests: int) -> None:
    latencies: list[float] = []
    failures: dict[str, int] = {}
    todo = iter(range(num_requests))
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as client:

        async def one_client() -> None:
            for i in todo:
                start = time.perf_counter()
                try:
                    r = await client.post("/v1/jobs", json={
                        "prompt": f"bench prompt {i}", "width": 64, "height": 64,
                        "num_frames": 9, "num_inference_steps": 4, "class": "batch",
                    })
                    outcome = str(r.status_code)
                except httpx.TransportError as exc:
                    outcome = type(exc).__name__
                if outcome == "201":
                    latencies.append(time.perf_counter() - start)
                else:
                    failures[outcome] = failures.get(outcome, 0) + 1

        began = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(num_clients)))
        elapsed = time.perf_counter() - began
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [0.0] * 99
    print(f"{len(latencies)} submits in {elapsed:.1f}s with {num_clients} clients: "
          f"{len(latencies) / elapsed:.0f}/s; p50 {q[49] * 1e3:.0f} ms, p99 {q[98] * 1e3:.0f} ms")
    if failures:
        print(f"failures: {failures}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", required=True, help="an API key (kiln keys create --user bench)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    asyncio.run(run(args.url, args.key, args.clients, args.requests))


if __name__ == "__main__":
    main()

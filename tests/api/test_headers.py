"""Every answer carries ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy: no-referrer``,
and every HTML page a Content-Security-Policy with ``default-src``, ``connect-src``,
``frame-ancestors`` and ``form-action``: each operation of the OpenAPI document (with real ids,
as a user), the dashboard's pages with and without a key, their assets, ``/docs``, and refusals
(401, 404, 413), over real HTTP. With an S3 output store, the pages' policy lets them fetch and
show the store's presigned URLs, and no other origin."""

from __future__ import annotations

import base64
import hashlib
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from servers import Server

from api.app import create_app
from api.routes import docs
from storage import lifecycle
from storage.outputs import thumbnail_key, video_key

if TYPE_CHECKING:
    from conftest import Api

JOB = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
       "num_inference_steps": 4}
FULL_POLICY = {"default-src 'self'", "connect-src 'self'", "frame-ancestors 'none'",
               "form-action 'self'"}


def _directives(response: httpx.Response) -> dict[str, str]:
    policy = response.headers["Content-Security-Policy"]
    return {d.strip().split(" ", 1)[0]: d.strip() for d in policy.split(";") if d.strip()}


def _check(response: httpx.Response) -> None:
    where = f"{response.request.method} {response.request.url.path} ({response.status_code})"
    assert response.headers.get("X-Content-Type-Options") == "nosniff", where
    assert response.headers.get("Referrer-Policy") == "no-referrer", where
    if response.headers.get("content-type", "").startswith("text/html"):
        assert FULL_POLICY <= set(_directives(response).values()), where


def test_every_route_and_page_carries_the_security_headers(api: Api) -> None:
    r = api.client.post("/v1/jobs", json=JOB, headers=api.auth("alice"))
    job_id = r.json()["id"]
    api.finish(job_id)
    r = api.client.post("/v1/batches", json={"jobs": [JOB]}, headers=api.auth("alice"))
    batch_id = r.json()["id"]
    ids = {"job_id": job_id, "batch_id": batch_id, "video_id": job_id, "file_id": "0" * 20,
           "adapter_id": "0" * 20}
    operations = [(method.upper(), path)
                  for path, ops in api.client.get("/openapi.json").json()["paths"].items()
                  for method in ops]
    assert len(operations) >= 24
    assets = re.findall(r'src="(/dashboard/assets/[^"]+)"|href="(/dashboard/assets/[^"]+)"',
                        api.client.get("/dashboard").text)
    pages = ["/dashboard", f"/dashboard/jobs/{job_id}", f"/dashboard/batches/{batch_id}",
             "/docs", "/openapi.json", *{a or b for a, b in assets}, "/dashboard/assets/page.js",
             "/dashboard/assets/job_page.js", "/dashboard/assets/batch_page.js"]

    app = create_app(api.settings, engine=api.db.engine, redis=api.redis,  # type: ignore[attr-defined]
                     store=api.store)
    seen: list[tuple[str, str, int, str]] = []
    with Server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        def visit(method: str, path: str, **kwargs: object) -> None:
            # Streamed, so that /v1/events is checked without waiting for the stream to end.
            with http.stream(method, path, **kwargs) as response:  # type: ignore[arg-type]
                _check(response)
                seen.append((method, path, response.status_code,
                             response.headers.get("content-type", "")))

        for method, path in operations:
            body = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
            visit(method, path.format(**ids), headers=api.auth("alice"), **body)
        for page in pages:
            visit("GET", page)  # without a key: the pages' shells
            visit("GET", page, headers=api.auth("alice"))
        visit("POST", "/v1/jobs", json=JOB, headers=api.auth("bob"))  # 201
        visit("GET", "/v1/jobs")  # 401
        visit("GET", "/no/such/path")  # 404
        visit("GET", f"/dashboard/jobs/{job_id}", headers=api.auth("bob"))  # another's: 404
        visit("POST", "/v1/jobs", headers=api.auth("alice"),
              content=b"x" * (api.settings.max_body_bytes + 1))  # 413, from the size limit
    statuses = {status for _, _, status, _ in seen}
    assert {200, 201, 401, 404, 413, 422} <= statuses, statuses
    html = [(method, path) for method, path, status, kind in seen
            if kind.startswith("text/html") and status == 200]
    assert len(html) >= 7, html  # /dashboard, two pages with and without a key, /docs
    assert ("GET", "/v1/events", 200, "text/event-stream; charset=utf-8") in seen


def test_the_pages_policy_runs_only_kilns_own_scripts(api: Api) -> None:
    r = api.client.get("/dashboard")
    directives = _directives(r)
    assert directives["script-src"] == "script-src 'self'"
    assert directives["style-src"] == "style-src 'self'"
    assert directives["object-src"] == "object-src 'none'"
    assert "unsafe" not in directives["script-src"] + directives["default-src"]
    # Every script and stylesheet the page names is kiln's own.
    assert re.findall(r'<script src="([^"]+)"', r.text) == [
        "/dashboard/assets/kiln.js", "/dashboard/assets/dashboard.js"]
    assert "<script>" not in r.text and "<style" not in r.text


def test_docs_allow_exactly_swagger_ui_and_its_inline_script(api: Api) -> None:
    r = api.client.get("/docs")
    assert r.status_code == 200
    directives = _directives(r)
    scripts = re.findall(r'<script src="([^"]+)"', r.text)
    inline = re.findall(r"<script>(.*?)</script>", r.text, re.DOTALL)
    styles = re.findall(r'<link[^>]*rel="stylesheet"[^>]*href="([^"]+)"', r.text)
    assert scripts == [docs.SWAGGER_JS] and styles == [docs.SWAGGER_CSS] and len(inline) == 1
    digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    assert directives["script-src"] == f"script-src {docs.SWAGGER_JS} 'sha256-{digest}'"
    assert docs.SWAGGER_CSS in directives["style-src"]
    assert "url: '/openapi.json'" in inline[0]
    assert "https://" not in r.text.replace(docs.SWAGGER_JS, "").replace(docs.SWAGGER_CSS, "")
    assert api.client.get("/redoc").status_code == 404


@pytest.mark.parametrize(("endpoint", "origin"), [
    ("http://minio.internal:9000", "http://minio.internal:9000"),  # an S3-compatible server
    (None, "https://kiln-out.s3.amazonaws.com"),  # AWS itself: the bucket's own host
])
def test_with_an_s3_store_the_pages_may_fetch_and_show_its_presigned_urls(
        api: Api, endpoint: str | None, origin: str) -> None:
    s3 = api.settings.model_copy(update={
        "storage_url": "s3://kiln-out/renders", "s3_endpoint_url": endpoint,
        "s3_region": "us-east-1", "s3_access_key_id": "kiln-test",
        "s3_secret_access_key": SecretStr("kiln-test-secret-0123456789")})
    # The output store is the one the settings make: no S3 server is asked anything.
    app = create_app(s3, engine=api.db.engine, redis=api.redis)  # type: ignore[attr-defined]
    with TestClient(app) as client:
        job_id = client.post("/v1/jobs", json=JOB, headers=api.auth("alice")).json()["id"]
        with api.session() as s:
            claim = lifecycle.claim_job(s, job_id, worker_group_id="g", rank=0, lease_seconds=60)
            assert claim is not None
            assert lifecycle.finish_succeeded(s, job_id, claim.attempt_token,
                                              video_key=video_key(job_id),
                                              thumbnail_key=thumbnail_key(job_id))
        for which in ("video", "thumbnail"):
            r = client.get(f"/v1/jobs/{job_id}/{which}", headers=api.auth("alice"),
                           follow_redirects=False)
            assert r.status_code == 307
            location = urlsplit(r.headers["Location"])
            assert f"{location.scheme}://{location.netloc}" == origin
        directives = _directives(client.get("/dashboard"))
    assert directives["connect-src"] == f"connect-src 'self' {origin}"
    assert directives["img-src"] == f"img-src 'self' {origin} blob: data:"
    assert directives["media-src"] == f"media-src 'self' {origin} blob:"
    assert directives["default-src"] == "default-src 'self'"
    assert directives["script-src"] == "script-src 'self'"
    # A local store: the API serves the files itself, and the policy names no other origin.
    assert _directives(api.client.get("/dashboard"))["connect-src"] == "connect-src 'self'"

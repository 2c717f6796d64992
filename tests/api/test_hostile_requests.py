"""Malformed and hostile requests: each gets a 4xx with a reason, never a 500, and none of them
changes the database or the Redis queue index."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.bodies import MAX_JSON_DEPTH
from scheduler import queue_index

OK_BODY = {"prompt": "a red circle", "width": 64, "height": 64, "num_frames": 9,
           "num_inference_steps": 4}


def body(**changes: Any) -> dict[str, Any]:
    return {"json": {**OK_BODY, **changes}}


def raw(text: str | bytes, content_type: str = "application/json") -> dict[str, Any]:
    return {"content": text, "headers": {"Content-Type": content_type}}


def chunks(total: int) -> Iterator[bytes]:
    yield b'{"prompt": "'
    for _ in range(total // 1024):
        yield b"x" * 1024
    yield b'"}'


def cursor(stamp: str) -> str:
    """A cursor in the shape the API makes, at ``stamp``."""
    return base64.urlsafe_b64encode(f"{stamp}|{'a' * 20}".encode()).decode().rstrip("=")


def nested(levels: int, inner: str = "") -> str:
    return "[" * levels + inner + "]" * levels


# Times with no UTC equivalent: converting them overflows the datetime range.
YEAR_1_EAST = cursor("0001-01-01T00:00:00+14:00")
YEAR_9999_WEST = cursor("9999-12-31T23:59:59-14:00")
DEEP = nested(30_000)
DEEP_SMALL = nested(8_000)  # under the jobs' 16 KiB body limit of these tests
JSONL_LINE = json.dumps({"prompt": "a red circle"})


# (name, who, method, path, request kwargs, expected status). "{alice_job}" is alice's job id.
CASES: list[tuple[str, str | None, str, str, dict[str, Any], int]] = [
    ("missing key", None, "POST", "/v1/jobs", body(), 401),
    ("unknown key", "bad", "POST", "/v1/jobs", body(), 401),
    ("well-formed unknown key", "forged", "GET", "/v1/jobs", {}, 401),
    ("basic auth scheme", "basic", "GET", "/v1/jobs", {}, 401),
    ("width is a string", "alice", "POST", "/v1/jobs", body(width="abc"), 422),
    ("width is a bool", "alice", "POST", "/v1/jobs", body(width=True), 422),
    ("width is huge", "alice", "POST", "/v1/jobs", body(width=100_000), 422),
    ("width over the deployment limit", "alice", "POST", "/v1/jobs", body(width=4096), 422),
    ("width not a multiple of 8", "alice", "POST", "/v1/jobs", body(width=65), 422),
    ("width a multiple of 8, not of the family's 16", "alice", "POST", "/v1/jobs",
     body(width=72), 422),
    ("height a multiple of 8, not of the family's 16", "alice", "POST", "/v1/jobs",
     body(height=1912), 422),
    ("frames off the 1 + 4k rule", "alice", "POST", "/v1/jobs", body(num_frames=10), 422),
    ("frames off the rule for another model", "alice", "POST", "/v1/jobs",
     body(model="kiln-big", num_frames=6), 422),
    ("job over the token bound", "alice", "POST", "/v1/jobs",
     body(width=1920, height=1920, num_frames=9), 422),
    ("job over the work bound", "alice", "POST", "/v1/jobs",
     body(width=1024, height=1024, num_frames=13, num_inference_steps=200), 422),
    ("largest size, longest clip", "alice", "POST", "/v1/jobs",
     body(width=1920, height=1920, num_frames=257, num_inference_steps=200), 422),
    ("negative height", "alice", "POST", "/v1/jobs", body(height=-64), 422),
    ("zero frames", "alice", "POST", "/v1/jobs", body(num_frames=0), 422),
    ("a million frames", "alice", "POST", "/v1/jobs", body(num_frames=10**6), 422),
    ("negative steps", "alice", "POST", "/v1/jobs", body(num_inference_steps=-5), 422),
    ("steps over the limit", "alice", "POST", "/v1/jobs", body(num_inference_steps=201), 422),
    ("zero fps", "alice", "POST", "/v1/jobs", body(fps=0), 422),
    ("NaN guidance", "alice", "POST", "/v1/jobs",
     raw('{"prompt": "p", "guidance_scale": NaN}'), 422),
    ("infinite guidance", "alice", "POST", "/v1/jobs",
     raw('{"prompt": "p", "guidance_scale": 1e400}'), 422),
    ("empty prompt", "alice", "POST", "/v1/jobs", body(prompt=""), 422),
    ("blank prompt", "alice", "POST", "/v1/jobs", body(prompt="   "), 422),
    ("prompt is a number", "alice", "POST", "/v1/jobs", body(prompt=123), 422),
    ("prompt too long", "alice", "POST", "/v1/jobs", body(prompt="x" * 501), 422),
    ("NUL in prompt", "alice", "POST", "/v1/jobs", body(prompt="a\x00b"), 422),
    ("lone surrogate in prompt", "alice", "POST", "/v1/jobs",
     raw('{"prompt": "a\\ud800b"}'), 422),
    ("unknown field", "alice", "POST", "/v1/jobs", body(foo=1), 422),
    ("unknown model", "alice", "POST", "/v1/jobs", body(model="../../weights"), 422),
    ("priority out of range", "alice", "POST", "/v1/jobs", body(priority=99), 422),
    ("unknown class", "alice", "POST", "/v1/jobs", body(**{"class": "vip"}), 422),
    ("negative seed", "alice", "POST", "/v1/jobs", body(seed=-1), 422),
    ("seed beyond 64 bits", "alice", "POST", "/v1/jobs", body(seed=2**70), 422),
    ("file webhook", "alice", "POST", "/v1/jobs", body(webhook_url="file:///etc/passwd"), 422),
    ("metadata too many keys", "alice", "POST", "/v1/jobs",
     body(metadata={f"k{i}": i for i in range(100)}), 422),
    ("metadata nested", "alice", "POST", "/v1/jobs", body(metadata={"a": {"b": 1}}), 422),
    ("metadata too big", "alice", "POST", "/v1/jobs",
     body(metadata={f"k{i}": "v" * 1000 for i in range(8)}), 422),
    ("deadline in the past", "alice", "POST", "/v1/jobs",
     body(deadline="2001-01-01T00:00:00Z"), 422),
    ("not_before is garbage", "alice", "POST", "/v1/jobs", body(not_before="tomorrow"), 422),
    ("not_before without a time zone", "alice", "POST", "/v1/jobs",
     body(not_before="2030-01-01T00:00:00"), 422),
    ("not_before years ahead", "alice", "POST", "/v1/jobs",
     body(not_before="2999-01-01T00:00:00Z"), 422),
    ("not_before at year 1 east of UTC", "alice", "POST", "/v1/jobs",
     body(not_before="0001-01-01T00:00:00+01:00"), 422),
    ("not_before centuries ago", "alice", "POST", "/v1/jobs",
     body(not_before="1900-01-01T00:00:00Z"), 422),
    ("deeply nested JSON", "alice", "POST", "/v1/jobs", raw("[" * 5_000 + "]" * 5_000), 400),
    ("NUL in a list filter", "alice", "GET", "/v1/jobs?model=a%00b", {}, 422),
    ("NUL in the owner filter", "root", "GET", "/v1/jobs?owner=a%00b", {}, 422),
    ("NUL in a key", "nulkey", "GET", "/v1/jobs", {}, 401),
    ("oversized body", "alice", "POST", "/v1/jobs", body(prompt="x" * 20_000), 413),
    ("oversized streamed body", "alice", "POST", "/v1/jobs",
     {"content": lambda: chunks(64 * 1024), "headers": {"Content-Type": "application/json"}},
     413),
    ("non-numeric Content-Length", "alice", "POST", "/v1/jobs",
     {"content": b"{}", "headers": {"Content-Length": "abc",
                                    "Content-Type": "application/json"}}, 400),
    ("broken JSON", "alice", "POST", "/v1/jobs", raw('{"prompt": "p"'), 422),
    ("JSON array", "alice", "POST", "/v1/jobs", raw('["prompt"]'), 422),
    ("empty body", "alice", "POST", "/v1/jobs", raw(""), 422),
    ("not JSON at all", "alice", "POST", "/v1/jobs", raw("prompt=p", "text/plain"), 422),
    ("idempotency key too long", "alice", "POST", "/v1/jobs",
     {"json": OK_BODY, "headers": {"Idempotency-Key": "k" * 300}}, 422),
    ("idempotency key reused with another body", "alice", "POST", "/v1/jobs",
     {"json": {**OK_BODY, "prompt": "different"}, "headers": {"Idempotency-Key": "setup"}}, 409),
    ("encoded path traversal id", "alice", "GET", "/v1/jobs/..%2F..%2Fetc%2Fpasswd", {}, 404),
    ("dot-dot id", "alice", "GET", "/v1/jobs/%2e%2e", {}, 404),
    ("overlong id", "alice", "GET", "/v1/jobs/" + "a" * 5000, {}, 404),
    ("another user's job", "bob", "GET", "/v1/jobs/{alice_job}", {}, 404),
    ("cancel another user's job", "bob", "POST", "/v1/jobs/{alice_job}/cancel", {}, 404),
    ("another user's video", "bob", "GET", "/v1/jobs/{alice_job}/video", {}, 404),
    ("another user's OpenAI video", "bob", "GET", "/v1/videos/{alice_job}", {}, 404),
    ("delete another user's video", "bob", "DELETE", "/v1/videos/{alice_job}", {}, 404),
    ("video not finished", "alice", "GET", "/v1/jobs/{alice_job}/video", {}, 409),
    ("garbage cursor", "alice", "GET", "/v1/jobs?cursor=AAAA", {}, 422),
    ("zero limit", "alice", "GET", "/v1/jobs?limit=0", {}, 422),
    ("huge limit", "alice", "GET", "/v1/jobs?limit=100000", {}, 422),
    ("unknown status filter", "alice", "GET", "/v1/jobs?status=bogus", {}, 422),
    ("wrong method", "alice", "PUT", "/v1/jobs", body(), 405),
    ("videos: bad size", "alice", "POST", "/v1/videos", {"data": {"prompt": "p", "size": "abc"}},
     422),
    ("videos: negative seconds", "alice", "POST", "/v1/videos",
     {"data": {"prompt": "p", "seconds": "-4"}}, 422),
    ("videos: too many seconds", "alice", "POST", "/v1/videos",
     {"data": {"prompt": "p", "seconds": "9999"}}, 422),
    ("videos: size over the limit", "alice", "POST", "/v1/videos",
     {"data": {"prompt": "p", "size": "7680x4320"}}, 422),
    ("videos: size a multiple of 8, not of 16", "alice", "POST", "/v1/videos",
     {"data": {"prompt": "p", "size": "1912x1080"}}, 422),
    ("videos: job over the token bound", "alice", "POST", "/v1/videos",
     {"data": {"prompt": "p", "size": "1920x1920", "seconds": "4"}}, 422),
    ("videos: job over the work bound", "alice", "POST", "/v1/videos",
     {"json": {"prompt": "p", "size": "1024x1024", "seconds": "1", "fps": 4,
               "num_inference_steps": 200}}, 422),
    ("videos: reference upload that is no image", "alice", "POST", "/v1/videos",
     {"data": {"prompt": "p"}, "files": {"input_reference": ("a.png", b"png", "image/png")}},
     415),
    ("videos: a file in another field", "alice", "POST", "/v1/videos",
     {"data": {"prompt": "p"}, "files": {"prompt": ("a.png", b"png", "image/png")}}, 422),
    ("another user's file", "bob", "GET", "/v1/files/{alice_job}", {}, 404),
    ("videos: unknown JSON field", "alice", "POST", "/v1/videos",
     {"json": {"prompt": "p", "bogus": 1}}, 422),
    ("videos: plain text body", "alice", "POST", "/v1/videos", raw("p", "text/plain"), 415),
    ("videos: unknown variant", "alice", "GET", "/v1/videos/{alice_job}/content?variant=sprite",
     {}, 422),
    ("videos: after unknown id", "alice", "GET", "/v1/videos?after=nosuchvideo", {}, 404),
    ("cursor at year 1 east of UTC", "alice", "GET", f"/v1/jobs?cursor={YEAR_1_EAST}", {}, 422),
    ("cursor at year 9999 west of UTC", "alice", "GET", f"/v1/jobs?cursor={YEAR_9999_WEST}", {},
     422),
    ("batches: cursor at year 1 east of UTC", "alice", "GET",
     f"/v1/batches?cursor={YEAR_1_EAST}", {}, 422),
    ("batches: cursor at year 9999 west of UTC", "alice", "GET",
     f"/v1/batches?cursor={YEAR_9999_WEST}", {}, 422),
    ("videos: after an extreme cursor", "alice", "GET", f"/v1/videos?after={YEAR_1_EAST}", {},
     404),
    ("deep JSON without a Content-Type", "alice", "POST", "/v1/jobs",
     {"content": DEEP_SMALL}, 400),
    ("deep JSON inside the metadata", "alice", "POST", "/v1/jobs",
     raw(json.dumps(OK_BODY)[:-1] + ', "metadata": {"a": ' + nested(8_000, "1") + "}}"), 400),
    ("videos: deep JSON", "alice", "POST", "/v1/videos", raw(DEEP_SMALL), 400),
    ("batches: JSON nested 30,000 levels", "alice", "POST", "/v1/batches", raw(DEEP), 400),
    ("batches: jobs nested 30,000 levels", "alice", "POST", "/v1/batches",
     raw('{"jobs": ' + DEEP + "}"), 400),
    ("batches: JSONL nested 30,000 levels", "alice", "POST", "/v1/batches",
     raw(DEEP, "application/x-ndjson"), 400),
    ("batches: one deep JSONL line among good ones", "alice", "POST", "/v1/batches",
     raw("\n".join([JSONL_LINE, nested(30_000, "{}"), JSONL_LINE]), "application/x-ndjson"),
     400),
    ("batches: unclosed JSONL nesting", "alice", "POST", "/v1/batches",
     raw("[" * 30_000, "application/x-ndjson"), 400),
    ("batches: deep JSONL upload", "alice", "POST", "/v1/batches",
     {"files": {"file": ("b.jsonl", DEEP.encode(), "application/x-ndjson")}}, 400),
    ("batches: deep defaults field", "alice", "POST", "/v1/batches",
     {"files": {"file": ("b.jsonl", JSONL_LINE.encode(), "application/x-ndjson")},
      "data": {"defaults": DEEP}}, 400),
    ("batches: more JSONL lines than a user may queue", "alice", "POST", "/v1/batches",
     raw("\n".join([JSONL_LINE] * 6), "application/x-ndjson"), 422),
]


def _ready_members(api) -> list[tuple[str, list[bytes]]]:  # noqa: ANN001
    return [(k, api.redis.zrange(k, 0, -1))
            for k in queue_index.ready_keys(api.settings.redis_prefix)]


def test_hostile_requests_get_a_4xx_with_a_reason_and_change_nothing(api) -> None:  # noqa: ANN001
    assert len(CASES) >= 30
    setup = api.client.post("/v1/jobs", json=OK_BODY,
                            headers={**api.auth("alice"), "Idempotency-Key": "setup"})
    assert setup.status_code == 201
    alice_job = setup.json()["id"]
    before, index_before = api.snapshot(), _ready_members(api)
    auth = {
        None: {}, "bad": {"Authorization": "Bearer nope"},
        "forged": {"Authorization": "Bearer kiln_" + "a" * 52},
        "basic": {"Authorization": "Basic YWxpY2U6cGFzcw=="},
        "nulkey": {"Authorization": "Bearer kiln_\x00" + "a" * 51},
        "alice": api.auth("alice"), "bob": api.auth("bob"), "root": api.auth("root"),
    }
    failures = []
    for name, who, method, path, kwargs, expected in CASES:
        kwargs = dict(kwargs)
        headers = {**auth[who], **kwargs.pop("headers", {})}
        if callable(kwargs.get("content")):  # a fresh generator per run (it is consumed)
            kwargs["content"] = kwargs["content"]()
        r = api.client.request(method, path.format(alice_job=alice_job), headers=headers,
                               **kwargs)
        try:
            reason = r.json().get("detail")
        except json.JSONDecodeError:
            reason = None
        if r.status_code != expected or not isinstance(reason, str) or not reason:
            failures.append((name, r.status_code, expected, r.text[:200]))
    assert failures == []
    assert api.snapshot() == before
    assert _ready_members(api) == index_before


@pytest.mark.parametrize("field,value,needle", [
    ("width", 4096, "width: must be between 16 and 1920"),
    ("num_inference_steps", 201, "num_inference_steps: at most 200"),
    ("foo", 1, "foo: unknown field"),
    ("prompt", "x" * 501, "prompt: at most 500 characters"),
    ("width", 72, "width: must be a multiple of 16, got 72; nearest: 64 or 80"),
    ("height", 1912, "height: must be a multiple of 16, got 1912; nearest: 1904 or 1920"),
    ("num_frames", 10, "num_frames: must be 1 + a multiple of 4 frames (1, 5, 9, ...), got 10; "
                       "nearest: 9 or 13"),
])
def test_validation_errors_name_the_field(api, field: str, value: object,  # noqa: ANN001
                                          needle: str) -> None:
    r = api.client.post("/v1/jobs", json={**OK_BODY, field: value}, headers=api.auth("alice"))
    assert r.status_code == 422
    assert needle in r.json()["detail"]
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("stamp", ["0001-01-01T00:00:00+14:00", "0001-01-01T00:00:00-14:00",
                                   "9999-12-31T23:59:59+14:00", "9999-12-31T23:59:59-14:00"])
def test_cursors_at_the_ends_of_time_are_a_page_or_a_422(api, stamp: str) -> None:  # noqa: ANN001
    before = api.snapshot()
    for path in ("/v1/jobs", "/v1/batches"):
        r = api.client.get(f"{path}?cursor={cursor(stamp)}", headers=api.auth("alice"))
        if r.status_code == 200:  # a time that exists in UTC: an (empty) page after it
            assert r.json()["data"] == [], (path, stamp)
        else:
            assert r.status_code == 422, (path, stamp, r.text)
            assert r.json()["detail"] == "cursor: cursor is not one this API returned"
    assert api.snapshot() == before


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/jobs", "application/json"), ("/v1/jobs", "application/merge-patch+json"),
    ("/v1/videos", "application/json"), ("/v1/batches", "application/json"),
    ("/v1/batches", "application/x-ndjson"),
])
def test_bodies_nested_30000_levels_are_refused_naming_the_limit(
        api, path: str, content_type: str) -> None:  # noqa: ANN001
    # The deployment's default body limit (64 KiB) lets a 30,000-level body through to the check.
    settings = api.settings.model_copy(update={"max_body_bytes": 64 * 1024})
    app = create_app(settings, engine=api.db.engine, redis=api.redis, store=api.store)
    before, index_before = api.snapshot(), _ready_members(api)
    with TestClient(app) as client:
        for body in (DEEP, "[" * 30_000, '{"prompt": "p", "a": ' + DEEP + "}"):
            r = client.post(path, content=body,
                            headers={**api.auth("alice"), "Content-Type": content_type})
            assert r.status_code == 400, r.text
            assert r.json()["detail"] == f"JSON nests deeper than {MAX_JSON_DEPTH} levels"
    assert api.snapshot() == before
    assert _ready_members(api) == index_before

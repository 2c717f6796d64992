"""Error responses and the request-body size limit.

Every error body carries ``detail`` (a sentence saying what was wrong) and ``error`` in the OpenAI
shape (``message``, ``type``, ``param``, ``code``), so both native clients and the OpenAI SDK get
a reason. Validation errors name the offending field. A database or Redis that cannot be reached
is a 503 with ``Retry-After`` (the client should come back; nothing is wrong with its request),
and anything unexpected is a 500 in the same JSON shape, never a traceback. A client that hangs up
while sending its body is a 400 and one log line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import redis.exceptions
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import headers
from storage.outages import is_database_outage

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status_code: int, message: str, *, param: str | None = None,
               code: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "detail": message,
        "error": {"message": message, "type": _TYPES.get(status_code, "api_error"),
                  "param": param, "code": code},
        **extra,
    }


def _field(loc: Sequence[Any]) -> str:
    # ("body", "width") -> "width"; ("query", "limit") -> "limit"; keep nested paths readable.
    parts = [str(p) for p in loc[1:]] if loc and loc[0] in ("body", "query", "path", "header") \
        else [str(p) for p in loc]
    return ".".join(parts) or "body"


def _message(err: dict[str, Any]) -> str:
    if err.get("type") == "json_invalid":
        return "body is not valid JSON"
    if err.get("type") == "extra_forbidden":
        return "unknown field"
    msg = str(err.get("msg", "invalid value"))
    return msg.removeprefix("Value error, ")


def validation_error_response(errors: Sequence[Any]) -> JSONResponse:
    items = [
        {"field": "body" if e.get("type") == "json_invalid" else _field(e.get("loc", ())),
         "message": _message(e), "type": e.get("type"),
         # A batch submission's errors also say which of its lines is at fault.
         **({"line": e["line"]} if e.get("line") is not None else {})}
        for e in errors
    ]
    summary = "; ".join(f"{i['field']}: {i['message']}" for i in items) or "invalid request"
    first = items[0] if items else {"field": None, "type": None}
    return JSONResponse(
        error_body(422, summary, param=first["field"], code=first["type"], errors=items),
        status_code=422,
    )


class Refusal(Exception):
    """A 4xx that names the parameter at fault and a stable code in the OpenAI shape (an
    HTTPException carries a message only)."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Refusal)
    async def _refusal(_: Request, exc: Refusal) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, exc.message, param=exc.param,
                                       code=exc.code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=exc.headers)

    async def _client_gone(request: Request, _: Exception) -> JSONResponse:  # a ClientDisconnect
        # A client that hangs up while sending its body (a closed laptop, a killed curl) is its
        # own doing, not the server's: one line, no traceback. Nobody reads the answer.
        log.info("%s %s: 400, the client disconnected before its whole body arrived",
                 request.method, request.url.path)
        return JSONResponse(error_body(400, "the client disconnected before its whole body "
                                            "arrived"), status_code=400)

    app.add_exception_handler(ClientDisconnect, _client_gone)

    async def _database_down(request: Request, exc: Exception) -> JSONResponse:
        if not is_database_outage(exc):
            raise exc  # a bug, not an outage: the 500 below
        return unavailable(request, "database", exc)

    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        return unavailable(request, "redis", exc)

    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # The server logs the traceback (Starlette re-raises after this response is sent).
        # Answered outside every middleware (Starlette's error middleware), so the headers
        # api.headers.SecurityHeaders adds elsewhere are set here.
        return JSONResponse(error_body(500, "internal error; the server log has the details",
                                       code="internal_error"), status_code=500,
                            headers=headers.COMMON)

    for db_error in (sqlalchemy.exc.OperationalError, sqlalchemy.exc.DBAPIError,
                     sqlalchemy.exc.TimeoutError, sqlalchemy.exc.DisconnectionError):
        app.add_exception_handler(db_error, _database_down)
    for redis_error in (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        app.add_exception_handler(redis_error, _redis_down)
    app.add_exception_handler(Exception, _unexpected)


def unavailable(request: Request, dependency: str, exc: BaseException) -> JSONResponse:
    """503 for a request that found ``dependency`` ("database" or "redis") unreachable."""
    log.warning("%s unavailable during %s %s: %s", dependency, request.method,
                request.url.path, type(exc).__name__)
    retry_after = request.app.state.settings.unavailable_retry_after_seconds
    return JSONResponse(
        error_body(503, f"{_NAMES[dependency]} is unreachable; retry in {retry_after} s",
                   code=f"{dependency}_unavailable"),
        status_code=503, headers={"Retry-After": str(retry_after)})


_NAMES = {"database": "the database", "redis": "Redis"}


class BodySizeLimit:
    """Refuses request bodies over ``max_bytes`` with 413, whether or not Content-Length is sent:
    a streamed body is counted as it arrives and cut off at the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}  # exact paths with their own limit (batch uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._reject(send, 400, "Content-Length is not a number")
                return
            if int(declared) > limit:
                await self._reject(send, 413, self._too_large(limit))
                return
        received = 0
        over = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    # Stop reading: the app sees an empty, finished body and fails to parse it;
                    # its response is replaced by the 413 below.
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await self._reject(send, 413, self._too_large(limit))
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

    @staticmethod
    def _too_large(limit: int) -> str:
        return f"request body is larger than the {limit} bytes allowed"

    @staticmethod
    async def _reject(send: Send, status_code: int, message: str) -> None:
        body = json.dumps(error_body(status_code, message)).encode()
        await send({"type": "http.response.start", "status": status_code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

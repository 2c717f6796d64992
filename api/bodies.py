"""JSON request bodies with bounded nesting.

Python's json parser recurses once per nesting level: a few kilobytes of ``[`` end in a
RecursionError, a 500. No request kiln takes nests more than a few levels, so the depth is
measured on the raw bytes before anything parses them: strings are cut out with one regular
expression and only the brackets are left to count. A 15 MiB document takes about 0.1 s, a
64 KiB job body well under a millisecond; a JSONL batch is checked line by line, so no single
call holds the interpreter long.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from itertools import accumulate
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute

# Far deeper than any body kiln accepts: a JSON batch's job metadata is at depth 4.
MAX_JSON_DEPTH = 32

# A JSON string: quotes around anything but a quote, a backslash or a line break, and escapes.
# Unrolled (no alternation per character) so that it runs in linear time.
_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = [0] * 256  # byte -> change of depth
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def nesting_depth(raw: bytes) -> int:
    """How deep the arrays and objects of ``raw`` nest (0 for a scalar). Brackets inside strings
    do not count; for invalid JSON the figure may be too high, never too low."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def too_deep() -> HTTPException:
    return HTTPException(status.HTTP_400_BAD_REQUEST,
                         f"JSON nests deeper than {MAX_JSON_DEPTH} levels")


def check_depth(raw: bytes | str) -> None:
    """400 when ``raw`` (a body, a JSONL line, a form field) nests deeper than
    `MAX_JSON_DEPTH`."""
    # Nothing nests deeper than its number of opening brackets: most bodies need no scan.
    if isinstance(raw, str):
        if raw.count("[") + raw.count("{") <= MAX_JSON_DEPTH:
            return
        raw = raw.encode("utf-8", "surrogatepass")
    elif raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    if nesting_depth(raw) > MAX_JSON_DEPTH:
        raise too_deep()


def loads(raw: bytes | str) -> Any:
    """``json.loads`` after `check_depth`: a 400 when too deep, ValueError when not JSON."""
    check_depth(raw)
    return json.loads(raw)


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this type as JSON: no type, or application/json or
    application/*+json."""
    if not content_type:
        return True
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


class DepthCheckedRoute(APIRoute):
    """A route whose JSON body is refused with 400 when it nests too deeply, before FastAPI
    parses it. The body read here is the one the route gets (Starlette keeps it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:  # FastAPI parses no body for this route
            return handler

        async def checked(request: Request) -> Response:
            if is_json(request.headers.get("content-type")):
                # Bodies here are at most max_body_bytes (64 KiB): the check is cheap enough
                # for the event loop.
                check_depth(await request.body())
            return await handler(request)

        return checked

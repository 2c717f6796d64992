"""The OpenAPI document declares the bearer key: every operation whose route depends on the
caller's user carries ``security: [{"HTTPBearer": []}]`` (Swagger UI's Authorize button sends the
key with those), and the public ones (health, metrics, the pages) carry none."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from api.deps import get_current_user, get_stream_user

_AUTHENTICATED = {get_current_user, get_stream_user}


def _calls(dependant: Dependant) -> Iterator[object]:
    for sub in dependant.dependencies:
        yield sub.call
        yield from _calls(sub)


def _routes(app: FastAPI) -> list[BaseRoute]:
    """The app's routes, those of its included routers among them."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # before FastAPI 0.16x an included router's routes were the app's own
        return list(app.routes)
    return [context.original_route for context in iter_route_contexts(app.routes)]


def _operations(app: FastAPI) -> dict[tuple[str, str], bool]:
    """(method, path) -> whether the route depends on the user, for every documented route."""
    found = {}
    for route in _routes(app):
        if isinstance(route, APIRoute) and route.include_in_schema:
            needs_user = any(c in _AUTHENTICATED for c in _calls(route.dependant))
            for method in route.methods:
                found[(method.lower(), route.path_format)] = needs_user
    return found


def test_every_authenticated_operation_declares_the_bearer_scheme(api) -> None:
    document = api.client.get("/openapi.json").json()
    scheme = document["components"]["securitySchemes"]["HTTPBearer"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer", scheme
    operations = _operations(api.app)
    authenticated = {op for op, needs in operations.items() if needs}
    public = {op for op, needs in operations.items() if not needs}
    # Both kinds exist: the walk below would pass vacuously otherwise.
    assert ("post", "/v1/jobs") in authenticated and ("get", "/v1/events") in authenticated
    assert ("get", "/healthz") in public, sorted(public)
    documented = set()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            documented.add((method, path))
            if operations[(method, path)]:
                assert operation.get("security") == [{"HTTPBearer": []}], (method, path)
            else:
                assert "security" not in operation, (method, path)
    assert documented == set(operations)


def test_a_key_sent_as_swagger_ui_authorizes_it_is_accepted(api) -> None:
    # Swagger UI's Authorize for an http bearer scheme sends exactly this header.
    r = api.client.get("/v1/jobs", headers={"Authorization": f"Bearer {api.keys['alice']}"})
    assert r.status_code == 200, r.text
    r = api.client.get("/v1/jobs", headers={"Authorization": "Bearer"})
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert r.json()["error"]["message"] == "Authorization must be 'Bearer <key>'"
    r = api.client.get("/v1/jobs")
    assert r.status_code == 401
    assert r.json()["error"]["message"] == \
        "missing API key: send 'Authorization: Bearer <key>'"

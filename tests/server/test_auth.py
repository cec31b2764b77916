"""With an API key, every route of the app answers 401 without it: the test walks the app's own
route table (every router included), so a route added later cannot be left open."""
from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from runtime.entrypoints.middleware import OPEN_PATHS, UTILITY_PATHS
from runtime.entrypoints.server import CORS, create_app

KEY = "secret"


def app_with_key(scope: str):
    # No engine: the key is checked before any route runs, and the lifespan (which starts the
    # engine) is not entered.
    return create_app(None, None, ["tiny"], None, KEY, scope, 1 << 20, CORS(["*"], ["*"], ["*"]),
                      False, enable_runtime_lora_updating=True, dev_mode=True)


def operations(routes) -> list[tuple[str, str]]:
    """(method, path) of every route, those of included routers too (FastAPI 0.165 keeps an
    included router as one entry; the app includes them without a prefix)."""
    found = []
    for route in routes:
        if hasattr(route, "original_router"):
            found += operations(route.original_router.routes)
            continue
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        methods = route.methods if isinstance(route, APIRoute) else {"GET"}
        found += [(method, path) for method in sorted(methods - {"HEAD"})]
    return found


@pytest.mark.parametrize("scope", ["v1", "all"])
def test_every_route_needs_the_key(scope):
    app = app_with_key(scope)
    client = TestClient(app, raise_server_exceptions=False)
    ops = operations(app.routes)
    assert {("POST", p) for p in ("/score", "/rerank", "/v2/rerank", "/classify", "/sleep",
                                  "/update_weights", "/inference/v1/generate")} <= set(ops)
    open_paths = OPEN_PATHS if scope == "all" else OPEN_PATHS + UTILITY_PATHS
    for method, path in ops:
        if path in open_paths:
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            reply = client.request(method, path, headers=headers, json={})
            assert reply.status_code == 401, (method, path, reply.status_code)
            error = reply.json()["error"]
            assert error["type"] == "authentication_error", reply.text
    assert client.get("/no/such/route").status_code == 401  # nothing is learnt without it
    assert client.get("/openapi.json").status_code == 200


def test_the_schema_marks_every_guarded_operation():
    schema = TestClient(app_with_key("all")).get("/openapi.json").json()
    for path, ops in schema["paths"].items():
        for op in ops.values():
            assert ("401" in op["responses"]) == (path not in OPEN_PATHS), path

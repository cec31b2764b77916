"""A generation model answers the pooling routes (/v1/embeddings, /score, /rerank, /classify)
with a 400 that says a pooling model is needed (tests/pooling/test_server.py: the reverse)."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY


@pytest.mark.parametrize("route,body", [
    ("/v1/embeddings", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
    ("/v1/rerank", {"query": "a", "documents": ["b"]}), ("/classify", {"input": "hi"})])
def test_generation_model_refuses_pooling_routes(tiny_server, route, body):
    reply = httpx.post(tiny_server.url + route, json=body, timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "needs a pooling model" in error["message"] and error["type"] == \
        "invalid_request_error", error

"""Schemathesis against the server's own OpenAPI schema: generated requests to both POST endpoints
never get a 5xx, and the server still answers afterwards."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, settings
from server_helpers import Server

schemathesis = pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server(tiny_models):
    with Server(tiny_models["llama"], "--max-model-len", "64") as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.include(method="POST").parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_request_gets_a_server_error(case, server):
    response = case.call(base_url=server.base, timeout=60)
    assert response.status_code < 500, (case.body, response.text[:500])


def test_the_server_still_answers_after_the_fuzzing(server):
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None

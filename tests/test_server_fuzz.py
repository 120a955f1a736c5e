"""Schemathesis against the server's own OpenAPI schema: generated requests, valid and invalid, to every POST
endpoint never get a 5xx, and the server still answers afterwards.

The test drives schemathesis's case strategies with Hypothesis directly instead of through its pytest plugin
(``schemathesis.pytest.from_fixture``), which depends on pytest internals that change between releases."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import Server

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def server(tiny_models):
    with Server(tiny_models["llama"], "--max-model-len", "64") as s:
        yield s


@pytest.fixture(scope="module")
def post_operations(server):
    schema = schemathesis.openapi.from_url(server.base + "/openapi.json").include(method="POST")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    return operations


def test_no_request_gets_a_server_error(server, post_operations):
    for operation in post_operations:
        # one strategy over schema-valid bodies and bodies that break the schema on purpose
        cases = st.one_of(*(operation.as_strategy(mode) for mode in schemathesis.GenerationMode))

        @given(case=cases)
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def never_a_server_error(case):
            response = case.call(base_url=server.base, timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        never_a_server_error()


def test_the_server_still_answers_after_the_fuzzing(server):
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None

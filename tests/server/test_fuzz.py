"""Schemathesis against the live server's own /openapi.json: for every operation, schema-valid
and schema-invalid requests, every response checked (no 5xx, status, content type, headers and
body as documented, invalid data refused), and /health still 200 at the end.

Schema-valid requests may still get a 400 where a limit depends on the model (a prompt longer
than the context, a token id beyond the vocabulary, a budget past the context): the schema
cannot know them, so `positive_data_acceptance` is the one check left out."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.server.conftest import TINY_ARGS, Server

EXAMPLES_PER_MODE = 120  # per operation, schema-valid and schema-invalid each
# A short context and queue keep each generating request small (the fuzzer sends thousands).
FUZZ_ARGS = ["--max-model-len", "48", "--max-queue-len", "8", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("fuzz") / "server.log")
    server = Server([tiny_llama, *TINY_ARGS, *FUZZ_ARGS, "--served-model-name", "tiny"], log)
    yield server
    assert server.stop() == 0, server.log()


def test_fuzz_the_openapi_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.update(base_url=server.url)
    sent = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            sent[f"{operation.label} {mode.value}"] = _fuzz(operation, mode)
    assert httpx.get(server.url + "/health").status_code == 200
    print(f"fuzzer: {sum(sent.values())} requests, 0 failures: {sent}")


def _fuzz(operation, mode: GenerationMode) -> int:
    count = 0

    @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        nonlocal count
        count += 1
        case.call_and_validate(excluded_checks=[schemathesis.checks.positive_data_acceptance],
                               timeout=60)

    try:
        run()
    except Unsatisfiable:  # nothing to get wrong (no body, no typed parameter)
        assert mode == GenerationMode.NEGATIVE and count == 0
    return count

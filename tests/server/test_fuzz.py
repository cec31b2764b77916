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

EXAMPLES_PER_MODE = 60  # per operation, schema-valid and schema-invalid each
# A short context and queue keep each generating request small (the fuzzer sends thousands).
FUZZ_ARGS = ["--max-model-len", "48", "--max-queue-len", "8", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("fuzz") / "server.log")
    server = Server([tiny_llama, *TINY_ARGS, *FUZZ_ARGS, "--served-model-name", "tiny"], log)
    yield server
    assert server.stop() == 0, server.log()


def test_fuzz_the_openapi_schema(server):
    _fuzz_server(server, EXAMPLES_PER_MODE)


# The other flavours of server, each fuzzed on the routes it adds, with fewer examples (CI time):
# (extra serve arguments, the model, the paths fuzzed)
FLAVOURS = {
    "guidance": (["--structured-outputs-config", '{"backend": "guidance"}'], "LlamaForCausalLM",
                 ("/v1/completions", "/v1/chat/completions", "/v1/responses")),
    "lora": (["--enable-lora", "--enable-runtime-lora-updating"], "LlamaForCausalLM",
             ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/completions")),
    "pooling": ([], "BertModel", ("/v1/embeddings", "/score", "/rerank", "/v2/rerank",
                                  "/classify")),
}
FLAVOUR_EXAMPLES_PER_MODE = 15


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_fuzz_each_server_flavour(flavour, tiny_model_factory, tmp_path):
    args, arch, paths = FLAVOURS[flavour]
    server = Server([tiny_model_factory(arch), *TINY_ARGS, *FUZZ_ARGS, *args,
                     "--served-model-name", "tiny"], str(tmp_path / "server.log"))
    try:
        _fuzz_server(server, FLAVOUR_EXAMPLES_PER_MODE, paths)
    finally:
        assert server.stop() == 0, server.log()


def _fuzz_server(server, examples: int, paths: tuple[str, ...] | None = None) -> None:
    """Every operation of the server's schema (on `paths`, if given), schema-valid and
    schema-invalid, `examples` of each; /health still 200 at the end."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.update(base_url=server.url)
    sent = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if paths is not None and operation.path not in paths:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            sent[f"{operation.label} {mode.value}"] = _fuzz(operation, mode, examples)
    assert sent and httpx.get(server.url + "/health").status_code == 200
    print(f"fuzzer: {sum(sent.values())} requests, 0 failures: {sent}")


def _fuzz(operation, mode: GenerationMode, examples: int) -> int:
    count = 0

    @settings(max_examples=examples, deadline=None, database=None,
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

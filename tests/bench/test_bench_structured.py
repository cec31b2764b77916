"""`runtime bench throughput --structured-outputs` on the tiny random model: the same requests
unconstrained and with a JSON schema each, and the per-step comparison (no timing asserted)."""
from __future__ import annotations

import json

import pytest

from runtime.bench.structured import schemas
from runtime.cli.main import main


@pytest.mark.parametrize("kind", ["json-unique"])  # json: the same path, one compile
def test_structured_workload_runs_both_ways(tiny_llama, tmp_path, kind):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", tiny_llama, "--backend", "runtime",
                 "--structured-outputs", kind, "--num-prompts", "4", "--input-len", "8",
                 "--output-len", "12", "--dtype", "float32", "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["backend"]: r for r in result["results"]}
    assert set(rows) == {"runtime", f"runtime+{kind}"}
    for row in rows.values():
        assert row["output_tokens"] == 4 * 12 and row["decode_step_ms"] > 0
        assert 0 < row["decode_batch"] <= 4  # json-unique: a request may start late
    so = result["structured_outputs"]
    assert so["kind"] == kind and so["structured_decode_step_ms"] > 0
    assert so["decode_step_overhead_pct"] == pytest.approx(
        100 * (so["structured_decode_step_ms"] / so["plain_decode_step_ms"] - 1))


def test_schemas_are_one_or_one_each():
    same, unique = schemas("json", 3), schemas("json-unique", 3)
    assert same[0] == same[2] and len({json.dumps(s) for s in unique}) == 3
    with pytest.raises(ValueError, match="--structured-outputs"):
        schemas("yaml", 1)


def test_structured_workload_is_refused_off_runtime(tiny_llama, capsys):
    assert main(["bench", "throughput", "--model", tiny_llama, "--backend", "runtime,hf",
                 "--structured-outputs", "json", "--num-prompts", "1"]) != 0
    assert "runtime backend only" in capsys.readouterr().err

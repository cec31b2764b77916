"""The structured workload of `runtime bench throughput --structured-outputs`: the same requests
run once unconstrained and once with a JSON schema each, and the grammar's cost per step.

`json` gives every request the same schema (compiled once, then cached, as a service with one
response format sees it); `json-unique` gives each its own (a property named after the request),
so every request compiles a grammar (vLLM's benchmark_serving_structured_output names). The
schema asks for a long list of records, so the grammar still constrains the last tokens of a
128-token output rather than allowing only the end of the text.
"""
from __future__ import annotations

from typing import Any

STRUCTURED_OUTPUTS = ("json", "json-unique")

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 40},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "email", "active", "tags"], "additionalProperties": False}


def schemas(kind: str, count: int) -> list[dict[str, Any]]:
    """One JSON schema per request."""
    if kind not in STRUCTURED_OUTPUTS:
        raise ValueError(f"--structured-outputs takes {' or '.join(STRUCTURED_OUTPUTS)}, "
                         f"got {kind!r}")

    def schema(i: int | None) -> dict[str, Any]:
        props = {"records": {"type": "array", "items": RECORD, "minItems": 16}}
        if i is not None:
            props[f"request_{i}"] = {"type": "integer"}
        return {"type": "object", "properties": props, "required": sorted(props),
                "additionalProperties": False}
    return [schema(i if kind == "json-unique" else None) for i in range(count)]


def overhead(plain: dict[str, Any], structured: dict[str, Any]) -> dict[str, Any]:
    """The structured run against the unconstrained one: time per decode step, tokens per
    second, and how much more a decode step takes (%)."""
    out = {"plain_decode_step_ms": plain.get("decode_step_ms", 0.0),
           "structured_decode_step_ms": structured.get("decode_step_ms", 0.0),
           "plain_output_tokens_per_s": plain["output_tokens_per_s"],
           "structured_output_tokens_per_s": structured["output_tokens_per_s"]}
    if out["plain_decode_step_ms"] and out["structured_decode_step_ms"]:
        out["decode_step_overhead_pct"] = 100.0 * (out["structured_decode_step_ms"]
                                                   / out["plain_decode_step_ms"] - 1)
    return out

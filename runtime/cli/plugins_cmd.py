"""`runtime plugins`: what was discovered, which platform is active and why."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from runtime.attention_backends.base import KV_CACHE_DTYPES, kv_cache_torch_dtype
from runtime.plugins.interfaces import ModelInfo, Platform
from runtime.plugins.manager import discovered_plugins, get_plugin_manager
from runtime.plugins.ops import COMPOSITES
from runtime.plugins.selection import (PlatformError, explain_attention_backends, explain_platforms,
                                       hook_answer, select_platform)

# The model shape used to ask which attention backend the active platform would choose.
SAMPLE_HEAD_SIZE = 64
SAMPLE_HEADS = 8
CUSTOM_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding", "linear")


def add_plugins_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `plugins` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "plugins", help="list plugins and platform candidates, and say which platform is active")
    parser.add_argument("--device", default=None,
                        help="force a platform by name (default: RUNTIME_DEVICE, else detection)")
    parser.add_argument("--attention-backend", default=None,
                        help="show what forcing this attention backend would do")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="show the attention candidates for this KV-cache dtype")
    parser.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                        help="pooling: the attention candidates for a pooling model (whole "
                             "requests, no KV cache; bidirectional for encoders)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=plugins_command)
    return parser


def plugins_command(args: argparse.Namespace) -> int:
    """Print the report; returns 0 when a platform is active, 1 when selection fails."""
    device = getattr(args, "device", None)
    report: dict[str, Any] = {
        "plugins": [asdict(r) for r in discovered_plugins()],
        "platforms": explain_platforms(device),
        "active": None,
        "error": None,
    }
    try:
        report["active"] = _active(select_platform(device),
                                   getattr(args, "attention_backend", None),
                                   getattr(args, "kv_cache_dtype", "auto"),
                                   getattr(args, "runner", "generate") == "pooling")
    except PlatformError as e:
        report["error"] = str(e)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
    else:
        print(_render(report))
    return 0 if report["active"] else 1


def _active(platform: Platform, requested: str | None = None,
            kv_cache_dtype: str = "auto", pooling: bool = False) -> dict[str, Any]:
    hook = get_plugin_manager().hook
    dtype = platform.default_dtype()
    model = ModelInfo(architecture="sample", dtype=dtype,
                      kv_cache_dtype=kv_cache_torch_dtype(kv_cache_dtype, dtype),
                      head_size=SAMPLE_HEAD_SIZE, num_heads=SAMPLE_HEADS,
                      num_kv_heads=SAMPLE_HEADS, pooling=pooling)
    try:
        backend = hook.runtime_attention_backend(platform=platform, model=model,
                                                 requested=requested)
        attention = (f"{backend.name} ({backend.__module__}.{backend.__qualname__}), chosen for "
                     f"head_size {SAMPLE_HEAD_SIZE}, {str(dtype).removeprefix('torch.')}, "
                     f"KV cache {kv_cache_dtype}"
                     if backend else "none offered")
    except Exception as e:  # the report must still print when a backend is broken
        attention = f"unavailable: {type(e).__name__}: {e}"
    try:
        runner, runner_by = hook_answer("runtime_graph_runner", platform=platform, model=model,
                                        enforce_eager=False)
        graph = runner.name if runner else "eager (no plugin answered)"
    except Exception as e:
        runner_by, graph = None, f"unavailable: {type(e).__name__}: {e}"
    explained = explain_attention_backends(platform, model, requested)
    answers = [{"hook": "runtime_attention_backend", "op": "", "answer": explained["chosen"],
                "answered_by": explained["answered_by"]},
               {"hook": "runtime_graph_runner", "op": "", "answer": graph,
                "answered_by": runner_by}]
    answers += custom_op_answers(platform)
    return {
        "name": platform.name,
        "facts": platform.describe(),
        "attention_backend": attention,
        "attention_backends": explained["backends"],
        "graph_runner": graph,
        "quantization": _quantization(platform),
        "answers": answers,
    }


def custom_op_answers(platform: Platform) -> list[dict[str, Any]]:
    """Who answers `runtime_custom_op` for each op name (composites as the model builds them)."""
    from runtime.layers.custom_ops import CustomOps
    ops = CustomOps(platform)
    rows = []
    for name in CUSTOM_OPS:
        try:
            op = ops(name)
            answer = ("composed" if name in COMPOSITES and ops.answered_by[name] else "portable"
                      ) if op is None else getattr(op, "__qualname__", type(op).__name__)
        except Exception as e:
            ops.answered_by[name] = None
            answer = f"unavailable: {type(e).__name__}: {e}"
        rows.append({"hook": "runtime_custom_op", "op": name, "answer": answer,
                     "answered_by": ops.answered_by[name]})
    return rows


def _quantization(platform: Platform) -> list[dict[str, Any]]:
    """Each quantization method: the kernel a plugin or the platform supplies, else the
    reference."""
    from runtime.quantization.registry import quantization_methods
    rows = []
    for name, cls in sorted(quantization_methods().items()):
        try:
            config = cls()
            kernel, who = hook_answer("runtime_quantization_kernel", platform=platform,
                                      method=config.kernel_method or name,
                                      params=config.kernel_params())
            chosen = (f"{kernel.name} ({who})" if kernel is not None else
                      f"{config.reference_kernel().name} (reference)")
        except Exception as e:
            chosen = f"unavailable: {type(e).__name__}: {e}"
        rows.append({"name": name, "kernel": chosen,
                     "fast_on": ", ".join(cls.fast_kernel_platforms) or "none (reference only)",
                     "weights": cls.weights_from})
    return rows


def _render(report: dict[str, Any]) -> str:
    lines = ["Plugins:"]
    lines += _table(["NAME", "SOURCE", "LOADED", "DETAIL"],
                    [[r["name"], r["source"], "yes" if r["loaded"] else "no",
                      r["reason"] or r["target"]] for r in report["plugins"]])
    lines += ["", "Platform candidates:"]
    lines += _table(["NAME", "PLUGIN", "PRIORITY", "DETECTED", "STATUS"],
                    [[p["name"], p["plugin"], str(p["priority"]), "yes" if p["detected"] else "no",
                      ("ACTIVE: " if p["active"] else "") + p["why"]]
                     for p in report["platforms"]])
    active = report["active"]
    if active is None:
        lines += ["", "No active platform:", report["error"]]
        return "\n".join(lines)
    lines += ["", f"Active platform: {active['name']}"]
    facts = {**active["facts"], "attention backend": active["attention_backend"],
             "graph runner": active["graph_runner"]}
    width = max(map(len, facts))
    lines += [f"  {k + ':':<{width + 1}} {v}" for k, v in facts.items()]
    lines += ["", "Hook answers (who answered, in pluggy's call order):"]
    lines += _table(["HOOK", "OP", "ANSWER", "ANSWERED BY"],
                    [[a["hook"], a["op"], str(a["answer"]), a["answered_by"] or "nobody"]
                     for a in active["answers"]])
    lines += ["", "Quantization methods:"]
    lines += _table(["METHOD", "KERNEL HERE", "FAST KERNEL ON", "WEIGHTS FROM"],
                    [[q["name"], q["kernel"], q["fast_on"], q["weights"]]
                     for q in active.get("quantization", [])])
    lines += ["", "Attention backends considered:"]
    lines += _table(["NAME", "PLUGIN", "PRIORITY", "USABLE", "STATUS"],
                    [[b["name"], b["plugin"], "" if b["priority"] is None else str(b["priority"]),
                      "yes" if b["usable"] else "no", ("CHOSEN: " if b["chosen"] else "") + b["why"]]
                     for b in active["attention_backends"]])
    return "\n".join(lines)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [headers, *rows]]

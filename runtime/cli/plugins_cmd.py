"""`runtime plugins`: what was discovered, which platform is active and why."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from runtime.attention_backends.base import KV_CACHE_DTYPES, kv_cache_torch_dtype
from runtime.plugins import kda_ops, recurrent_ops
from runtime.plugins.answers import PlatformAnswers
from runtime.plugins.interfaces import ModelInfo, Platform
from runtime.plugins.manager import discovered_plugins
from runtime.plugins.selection import (PlatformError, explain_attention_backends, explain_platforms,
                                       select_platform)

# The model shape used to ask which attention backend the active platform would choose.
SAMPLE_HEAD_SIZE = 64
SAMPLE_HEADS = 8
# Every name `runtime_custom_op` is asked for, in the order the hook's contract lists them
OP_NAMES = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding", "linear", "fused_moe",
            "gelu_tanh_and_mul", "gelu", "add_layer_norm", "gated_rms_norm", "lora_shrink",
            "lora_expand", *recurrent_ops.OPS, *kda_ops.OPS, "greedy_argmax")


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
        platform = select_platform(device)
        detected_by = next(p["plugin"] for p in report["platforms"] if p["active"])
        report["active"] = _active(platform, detected_by,
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


def _active(platform: Platform, detected_by: str, requested: str | None = None,
            kv_cache_dtype: str = "auto", pooling: bool = False) -> dict[str, Any]:
    dtype = platform.default_dtype()
    model = ModelInfo(architecture="sample", dtype=dtype,
                      kv_cache_dtype=kv_cache_torch_dtype(kv_cache_dtype, dtype),
                      head_size=SAMPLE_HEAD_SIZE, num_heads=SAMPLE_HEADS,
                      num_kv_heads=SAMPLE_HEADS, pooling=pooling)
    answers = PlatformAnswers(platform, requested)
    try:
        backend = answers.attention_backend(model)
        attention = (f"{backend.name} ({backend.__module__}.{backend.__qualname__}), chosen for "
                     f"head_size {SAMPLE_HEAD_SIZE}, {str(dtype).removeprefix('torch.')}, "
                     f"KV cache {kv_cache_dtype}")
    except Exception as e:  # the report must still print when a backend is broken
        attention = f"unavailable: {type(e).__name__}: {e}"
    graph = _asked(lambda: answers.graph_runner(model, enforce_eager=False).name)
    explained = explain_attention_backends(platform, model, requested)
    quantization = _quantization(answers)
    rows = [{"hook": "runtime_detect_platforms", "op": "", "answer": platform.name,
             "answered_by": detected_by},
            {"hook": "runtime_attention_backend_candidates", "op": "",
             "answer": ", ".join(b["name"] for b in explained["backends"]) or "none",
             "answered_by": ", ".join(dict.fromkeys(b["plugin"] for b in explained["backends"]))
             or None},
            *hook_answer_rows(answers)]
    return {
        "name": platform.name,
        "facts": platform.describe(),
        "attention_backend": attention,
        "attention_backends": explained["backends"],
        "graph_runner": graph,
        "quantization": quantization,
        "answers": rows,
    }


def hook_answer_rows(answers: PlatformAnswers) -> list[dict[str, Any]]:
    """Who answers every hook for `answers.platform`, one row per hook (per op, per
    quantization method): what `answers` has recorded, plus the hooks it asks here. Hooks a
    single-rank report cannot ask (`runtime_communicator` builds a process group) list who
    implements them, in call order."""
    for name in OP_NAMES:
        _asked(lambda: answers.custom_op(name))
    _asked(answers.logits_processors)
    _asked(answers.registered_models)
    _asked(answers.registered_kv_connectors)
    rows = [{"hook": r.hook, "op": r.about, "answer": r.answer, "answered_by": r.answered_by}
            for r in answers.records.values()]
    if not any(r.hook == "runtime_communicator" for r in answers.records.values()):
        rows.append({"hook": "runtime_communicator", "op": "",
                     "answer": "asked only with several ranks; implemented by",
                     "answered_by": answers.implementers("runtime_communicator")})
    return rows


def custom_op_answers(platform: Platform) -> list[dict[str, Any]]:
    """Who answers `runtime_custom_op` for each op name (composites as the model builds them)."""
    answers = PlatformAnswers(platform)
    for name in OP_NAMES:
        _asked(lambda: answers.custom_op(name))
    return [{"hook": r.hook, "op": r.about, "answer": r.answer, "answered_by": r.answered_by}
            for r in answers.records.values()]


def _asked(question: Any) -> Any:
    """The answer, or the error as the answer (the report must still print)."""
    try:
        return question()
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


def _quantization(answers: PlatformAnswers) -> list[dict[str, Any]]:
    """Each quantization method: the kernel a plugin or the platform supplies, else the
    reference."""
    from runtime.quantization.registry import quantization_methods
    rows = []
    for name, cls in sorted(quantization_methods().items()):
        try:
            config = cls()
            method = config.kernel_method or name
            kernel = answers.quantization_kernel(method, config.kernel_params())
            who = answers.records["runtime_quantization_kernel", method].answered_by
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

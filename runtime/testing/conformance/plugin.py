"""The suite's pytest plugin: the `--device NAME` option (pytest reads options before it loads
a --pyargs package's conftest, so the option lives here and is loaded with `-p`), and a header
saying which plugin answered each hook, so a vendor sees that their own code ran."""
from __future__ import annotations

import os

import pytest
import torch

DEVICE_ENV = "RUNTIME_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None,
                     help="the platform to test (default: RUNTIME_DEVICE, else detection)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    from runtime.cli.plugins_cmd import custom_op_answers
    from runtime.plugins.interfaces import ModelInfo
    from runtime.plugins.selection import PlatformError, hook_answer, select_platform
    try:
        platform = select_platform(config.getoption("--device") or os.environ.get(DEVICE_ENV))
    except PlatformError as e:
        return [f"no platform to test: {e}"]
    lines = [f"platform {platform.name}; who answered each hook (in pluggy's call order):"]

    def show(hook: str, what: str, call) -> None:
        try:
            answer, who = call()
            text = getattr(answer, "name", None) or ("none, the portable one runs"
                                                     if answer is None else type(answer).__name__)
        except Exception as e:  # the header must print whatever a plugin does
            text, who = f"raised {type(e).__name__}: {e}", None
        lines.append(f"  {hook}{what}: {text} ({who or 'nobody'})")

    for dtype in platform.supported_dtypes():
        model = ModelInfo("LlamaForCausalLM", dtype, dtype, head_size=64, num_heads=8,
                          num_kv_heads=2)
        show("runtime_attention_backend", f" [{str(dtype).removeprefix('torch.')}]",
             lambda: hook_answer("runtime_attention_backend", platform=platform, model=model,
                                 requested=None))
    model = ModelInfo("LlamaForCausalLM", torch.float32, torch.float32, 64, 8, 2)
    show("runtime_graph_runner", "", lambda: hook_answer(
        "runtime_graph_runner", platform=platform, model=model, enforce_eager=False))
    for method in ("int8", "int4", "fp8"):
        show("runtime_quantization_kernel", f" [{method}]", lambda: hook_answer(
            "runtime_quantization_kernel", platform=platform, method=method, params={}))
    lines += [f"  runtime_custom_op [{row['op']}]: {row['answer']} "
              f"({row['answered_by'] or 'nobody: portable'})"
              for row in custom_op_answers(platform)]
    from runtime.cli.plugins_cmd import hook_answer_rows
    from runtime.plugins.answers import PlatformAnswers
    lines += [f"  {row['hook']}: {row['answer']} ({row['answered_by'] or 'nobody'})"
              for row in hook_answer_rows(PlatformAnswers(platform)) if row["hook"] in (
                  "runtime_logits_processors", "runtime_register_models", "runtime_communicator")]
    return lines

"""An example runtime plugin: a fused RMSNorm for the CPU platform, and the Granite architecture.

The module is cheap to import: the model class is named by a "module:Class" string and imported
only when a Granite checkpoint is loaded.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from runtime.platforms.cpu.platform import CpuPlatform
from runtime.plugins.hookspecs import HOOK_API_VERSION, hookimpl
from runtime.plugins.interfaces import Platform

RUNTIME_HOOK_API_VERSION = HOOK_API_VERSION


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The portable op's numerics (normalise in float32, scale in the input dtype) in one
    `rms_norm` kernel instead of five elementwise passes."""
    return weight * F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


@hookimpl(tryfirst=True)
def runtime_custom_op(platform: Platform, name: str) -> Callable | None:
    """Replace rms_norm on the CPU platform (and platforms that subclass it); every other op and
    platform keeps its own."""
    if isinstance(platform, CpuPlatform) and name == "rms_norm":
        return fused_rms_norm
    return None


@hookimpl
def runtime_register_models() -> dict[str, str]:
    return {"GraniteForCausalLM": "runtime_example_plugin.granite:GraniteForCausalLM"}

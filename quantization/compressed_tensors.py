"""Checkpoints saved by compressed-tensors (llm-compressor): `quant_method: "compressed-tensors"`.

One config group targeting `Linear` layers is read, and its weight scheme picks the method:

| weights                                                   | format                 | method  |
| --------------------------------------------------------- | ---------------------- | ------- |
| type float, num_bits 8, strategy tensor or channel         | float-quantized        | `fp8`   |
| type float, num_bits 4, strategy tensor_group, group 16    | nvfp4-pack-quantized   | `nvfp4` |
| type float, num_bits 4, strategy group, group 32           | mxfp4-pack-quantized   | `mxfp4` |

`ignore` (layer names or "re:" regexes) leaves layers unquantized.
"""
from __future__ import annotations

from runtime.quantization.base import QuantizationConfig
from runtime.quantization.fp4 import Mxfp4Config, Nvfp4Config
from runtime.quantization.fp8 import Fp8Config

SUPPORTED = ("fp8 (float, 8 bits, strategy tensor or channel), nvfp4 (float, 4 bits, group 16), "
             "mxfp4 (float, 4 bits, group 32)")


def from_compressed_tensors(config: dict) -> QuantizationConfig:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: exactly one config group is supported, got "
                         f"{len(groups)} ({', '.join(groups) or 'none'})")
    group = next(iter(groups.values()))
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"compressed-tensors: only config groups targeting ['Linear'] are "
                         f"supported, got {targets}")
    w = group.get("weights") or {}
    acts = group.get("input_activations")
    ignore = list(config.get("ignore") or [])
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if kind == "float" and bits == 8 and strategy in ("tensor", "channel"):
        return Fp8Config(True, bool(acts) and not acts.get("dynamic", False), ignore)
    if kind == "float" and bits == 4 and w.get("group_size") == 16:
        return Nvfp4Config(ignore, input_global_scale=bool(acts))
    if kind == "float" and bits == 4 and w.get("group_size") == 32:
        return Mxfp4Config(ignore)
    raise ValueError(f"compressed-tensors weights {{type: {kind}, num_bits: {bits}, strategy: "
                     f"{strategy}, group_size: {w.get('group_size')}}} are not supported; "
                     f"supported: {SUPPORTED}")

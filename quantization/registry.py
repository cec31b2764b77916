"""Quantization methods by name, and how the engine picks one for a model.

A method is chosen by `--quantization NAME[:key=value,...]` (e.g. `int4:group_size=64,symmetric=0`)
or, when the flag is absent, by the checkpoint's own `quantization_config`: its `quant_method` is a
method name, or a checkpoint format that names the method inside (compressed-tensors). With both,
the flag must name the checkpoint's `quant_method` or the method it resolves to. Its kernel comes
from the platform through the `runtime_quantization_kernel` hook (first non-None answer wins),
asked for the config's `kernel_method` (default: its name), else the method's portable reference
kernel.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

from runtime.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

# method name -> "module:Class", imported when the method is first asked for (the method modules
# import nothing from here)
_METHODS = {
    "awq": "runtime.quantization.awq:AWQConfig",
    "fp8": "runtime.quantization.fp8:Fp8Config",
    "gguf": "runtime.quantization.gguf:GGUFConfig",
    "gptq": "runtime.quantization.gptq:GPTQConfig",
    "int4": "runtime.quantization.weight_only:Int4Config",
    "int8": "runtime.quantization.weight_only:Int8Config",
    "mxfp4": "runtime.quantization.fp4:Mxfp4Config",
    "nvfp4": "runtime.quantization.fp4:Nvfp4Config",
}


def _load(target: str) -> type[QuantizationConfig]:
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def quantization_methods() -> dict[str, type[QuantizationConfig]]:
    """Every method, by name."""
    return {name: _load(target) for name, target in _METHODS.items()}


def _checkpoint_formats() -> dict[str, Any]:
    """`quant_method` values that are checkpoint formats, not methods: format -> config parser."""
    from runtime.quantization.compressed_tensors import from_compressed_tensors
    return {"compressed-tensors": from_compressed_tensors}


def from_checkpoint(ckpt: dict) -> QuantizationConfig:
    """The method a checkpoint's `quantization_config` describes."""
    name = str(ckpt.get("quant_method", "")).lower()
    formats = _checkpoint_formats()
    if name in formats:
        return formats[name](ckpt)
    if name not in _METHODS:
        raise ValueError(f"checkpoint quant_method {name or '(none)'!r} is not supported; "
                         f"known: {', '.join(sorted([*_METHODS, *formats]))}")
    return get_method(name).from_checkpoint(ckpt)


def get_method(name: str) -> type[QuantizationConfig]:
    if name not in _METHODS:
        raise ValueError(f"unknown quantization method {name!r}; "
                         f"known: {', '.join(sorted(_METHODS))}")
    return _load(_METHODS[name])


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """"int4:group_size=64,symmetric=0" -> ("int4", {"group_size": "64", "symmetric": "0"})."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"quantization option {item!r} is not key=value (in {spec!r})")
        options[key.strip()] = value.strip()
    return name.strip().lower(), options


def checkpoint_quant_config(hf_config: Any) -> dict | None:
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        return None
    return cfg if isinstance(cfg, dict) else cfg.to_dict()


def build_quant_config(requested: str | None, hf_config: Any,
                       kernel_for: Callable[[str, dict[str, Any]], Any] | None = None
                       ) -> QuantizationConfig | None:
    """The model's quantization method with its kernel resolved, or None for dense weights.

    `kernel_for(method, params)` is the `runtime_quantization_kernel` hook's answer (a
    worker's `PlatformAnswers.quantization_kernel`); None from it, or no `kernel_for`: the
    method's reference kernel."""
    ckpt = checkpoint_quant_config(hf_config)
    if requested is None and ckpt is None:
        return None
    if ckpt is not None:
        ckpt_name = str(ckpt.get("quant_method", "")).lower()
        name = parse_spec(requested)[0] if requested is not None else ckpt_name
        if requested is not None:
            get_method(name)
            if name != ckpt_name and ckpt_name not in _checkpoint_formats():
                raise ValueError(f"--quantization {name} asked for, but the checkpoint is "
                                 f"quantized with {ckpt_name or 'an unnamed method'}")
        config = from_checkpoint(ckpt)
        if name not in (ckpt_name, config.name):
            raise ValueError(f"--quantization {name} asked for, but the checkpoint is quantized "
                             f"with {ckpt_name} ({config.name}); drop the flag or pass "
                             f"--quantization {config.name}")
    else:
        name, options = parse_spec(requested)
        config = get_method(name).from_options(options)
    kernel = None
    if kernel_for is not None:
        kernel = kernel_for(config.kernel_method or config.name, config.kernel_params())
    config.kernel = kernel if kernel is not None else config.reference_kernel()
    logger.info("quantization %s with kernel %s", config.name,
                getattr(config.kernel, "name", type(config.kernel).__name__))
    return config

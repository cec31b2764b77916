"""Quantization methods by name, and how the engine picks one for a model.

A method is chosen by `--quantization NAME[:key=value,...]` (e.g. `int4:group_size=64,symmetric=0`)
or, when the flag is absent, by the checkpoint's own `quantization_config`. Its kernel comes from
the platform through the `runtime_quantization_kernel` hook (first non-None answer wins), else the
method's portable reference kernel.
"""
from __future__ import annotations

import logging
from typing import Any

from quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

_METHODS: dict[str, type[QuantizationConfig]] = {}


def register_method(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
    _METHODS[cls.name] = cls
    return cls


def quantization_methods() -> dict[str, type[QuantizationConfig]]:
    """Every registered method, by name (built-ins imported on first call)."""
    import quantization.gguf
    import quantization.weight_only  # noqa: F401  (registers int8, int4)
    return dict(_METHODS)


def get_method(name: str) -> type[QuantizationConfig]:
    methods = quantization_methods()
    if name not in methods:
        raise ValueError(f"unknown quantization method {name!r}; known: {', '.join(sorted(methods))}")
    return methods[name]


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


def build_quant_config(requested: str | None, hf_config: Any, platform: Any = None,
                       hook: Any = None) -> QuantizationConfig | None:
    """The model's quantization method with its kernel resolved, or None for dense weights."""
    ckpt = checkpoint_quant_config(hf_config)
    if requested is None and ckpt is None:
        return None
    if requested is not None:
        name, options = parse_spec(requested)
        cls = get_method(name)
        if ckpt is not None:
            ckpt_name = str(ckpt.get("quant_method", "")).lower()
            if ckpt_name != name:
                raise ValueError(f"--quantization {name} asked for, but the checkpoint is "
                                 f"quantized with {ckpt_name or 'an unnamed method'}")
            config = cls.from_checkpoint(ckpt)
        else:
            config = cls.from_options(options)
    else:
        config = get_method(str(ckpt.get("quant_method", "")).lower()).from_checkpoint(ckpt)
    kernel = None
    if hook is not None:
        kernel = hook.runtime_quantization_kernel(platform=platform, method=config.name,
                                                  params=config.kernel_params())
    config.kernel = kernel if kernel is not None else config.reference_kernel()
    logger.info("quantization %s with kernel %s", config.name,
                getattr(config.kernel, "name", type(config.kernel).__name__))
    return config

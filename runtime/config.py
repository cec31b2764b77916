"""Engine configuration: what the user chose, and what follows from the model."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """`--dtype` as a torch dtype; None means the platform's default."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


def parse_memory(value: int | str | None) -> int | None:
    """`--kv-cache-memory` in bytes, from an int or a string like '4GiB', '512MB', '2G'."""
    if value is None or isinstance(value, int):
        return value
    text = value.strip().upper().replace("IB", "").rstrip("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '4GiB', got {value!r}") from None


@dataclass
class EngineConfig:
    """Everything the engine needs to start; `LLM(**kwargs)` and the CLI flags map onto it."""

    model: str | None = None  # HF folder, .gguf file, or None for the embedded default
    tokenizer: str | None = None
    device: str | None = None  # forces a platform; else RUNTIME_DEVICE, else detection
    dtype: torch.dtype | None = None  # None: the platform's default
    kv_cache_memory: int | None = None  # bytes; None: the platform's default share
    gpu_memory_utilization: float = 0.9  # accelerators: share of device memory the engine takes
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    enforce_eager: bool = False
    num_threads: int | None = None
    seed: int = 0
    trust_remote_code: bool = False
    model_impl: str = "auto"  # auto | native | transformers (runtime.models.registry)
    quantization: str | None = None  # a method in runtime.quantization.registry; None: the checkpoint's
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine-core replicas behind the server (AsyncLLM)
    distributed_executor_backend: str | None = None  # None: uniproc for one rank, else mp
    ray_address: str | None = None  # None: RAY_ADDRESS, else a new local Ray instance
    # speculative decoding: a SpeculativeConfig, or its dict / JSON text; None: off
    speculative_config: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from runtime.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding needs pipeline_parallel_size 1, got "
                             f"{self.pipeline_parallel_size}")
        self.dtype = parse_dtype(self.dtype)
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if self.device is None:
            self.device = os.environ.get("RUNTIME_DEVICE") or None
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        from runtime.models.registry import MODEL_IMPLS
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, "
                             f"got {self.model_impl!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {backend!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known - {'extra'})}")
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str, **overrides: Any) -> "EngineConfig":
        """Fields from a YAML mapping of EngineConfig names (as `runtime tune` writes), with
        `overrides` (e.g. the caller's explicit keywords) on top."""
        import yaml
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: an engine config must be a YAML mapping of option names")
        return cls.from_kwargs(**{**data, **overrides})

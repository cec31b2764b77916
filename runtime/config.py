"""Engine configuration: what the user chose, and what follows from the model."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from runtime.sampling_params import MAX_LOGPROBS

_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DTYPE_NAMES = tuple(_DTYPES)
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")
# vLLM's names for what we call otherwise; `LLM(...)` and the flags accept both.
KEYWORD_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}
EXECUTOR_BACKEND_ALIASES = {"uni": "uniproc"}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """`--dtype` as a torch dtype; None means the platform's default."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


def parse_size(value: int | str | None, name: str = "kv_cache_memory") -> int | None:
    """A byte or token count from an int or a string, as vLLM reads them: '4GiB', '4Gi', '4G'
    and '512MB' are binary (x1024), a lowercase unit alone is decimal ('32k' = 32000)."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:([kmgtKMGT])(i?)[bB]?)?\s*", value)
    if match is None:
        raise ValueError(f"{name} must be a count or a size like '4GiB' or '32k', got {value!r}")
    number, unit, binary = match.groups()
    if unit is None:
        return int(float(number))
    power = "kmgt".index(unit.lower()) + 1
    base = 1024 if unit.isupper() or binary else 1000
    return int(float(number) * base ** power)


@dataclass
class EngineConfig:
    """Everything the engine needs to start; `LLM(**kwargs)` and the CLI flags map onto it."""

    model: str | None = None  # HF folder, .gguf file, or None for the embedded default
    tokenizer: str | None = None
    device: str | None = None  # forces a platform; else RUNTIME_DEVICE, else detection
    dtype: torch.dtype | None = None  # None: the platform's default
    kv_cache_memory: int | None = None  # bytes; None: the platform's default share
    gpu_memory_utilization: float = 0.9  # accelerators: share of device memory the engine takes
    kv_cache_dtype: str = "auto"  # auto (the model's) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2
    calculate_kv_scales: bool = False  # FP8 KV: per-layer k/v scales from the first batch
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
    revision: str | None = None  # with a model id: the revision to take from the local HF cache
    download_dir: str | None = None  # with a model id: the HF cache folder (default: HF_HUB_CACHE)
    trust_remote_code: bool = False
    model_impl: str = "auto"  # auto | native | transformers (runtime.models.registry)
    runner: str = "auto"  # auto | generate | pooling (embeddings, classification: runtime.pooling)
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs / prompt_logprobs one request may ask for
    # sampling defaults: "auto" (the model's generation_config.json), "vllm" (none) or a folder
    generation_config: str = "auto"
    disable_log_stats: bool = False  # True: no periodic throughput lines in the log
    quantization: str | None = None  # a method in runtime.quantization.registry; None: the checkpoint's
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # MoE layers: whole experts split across the tensor-parallel group instead of a slice of each
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1  # engine-core replicas behind the server (AsyncLLM)
    # set by the server for each replica: which of the data_parallel_size_local replicas on this
    # host a core is (the host's cores are shared out between all their ranks)
    data_parallel_rank: int = 0
    data_parallel_size_local: int = 1
    distributed_executor_backend: str | None = None  # None: uniproc for one rank, else mp
    ray_address: str | None = None  # None: RAY_ADDRESS, else a new local Ray instance
    # speculative decoding: a SpeculativeConfig, or its dict / JSON text; None: off
    speculative_config: Any = None
    # structured outputs: a StructuredOutputsConfig, or its dict / JSON text ({"backend":
    # "guidance"}); None: the defaults (xgrammar)
    structured_outputs_config: Any = None
    # multi-LoRA (runtime.lora): adapters in max_loras device slots, max_cpu_loras in host memory
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from runtime.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from runtime.structured_output.backends import StructuredOutputsConfig
        self.structured_outputs_config = StructuredOutputsConfig.parse(
            self.structured_outputs_config)
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding needs pipeline_parallel_size 1, got "
                             f"{self.pipeline_parallel_size}")
        self.dtype = parse_dtype(self.dtype)
        self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        self.max_model_len = parse_size(self.max_model_len, "max_model_len")
        if self.device is None:
            self.device = os.environ.get("RUNTIME_DEVICE") or None
        from runtime.attention_backends.base import KV_CACHE_DTYPES
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
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
        backend = self.distributed_executor_backend = EXECUTOR_BACKEND_ALIASES.get(
            self.distributed_executor_backend, self.distributed_executor_backend)
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {backend!r}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the most the "
                             f"sampler returns), got {self.max_logprobs}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.enable_lora:  # a captured graph would not see each step's adapter slots
            self.enforce_eager = True
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        for name in ("max_loras", "max_lora_rank", "block_size", "max_num_seqs",
                     "max_num_batched_tokens",
                     "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        for alias, name in KEYWORD_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"give {alias} or {name}, not both")
                kwargs[name] = kwargs.pop(alias)
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

"""The model, resolved once: where its files are (the snapshot a model id and revision name), its
Hugging Face config, whether it generates or pools, the class that runs it and the facts the
engine needs (`ModelConfig`).

`LLM` and the API process resolve it once and hand the same object (pickled) to every engine
core and its process (whose workers get its source and `ModelConfig`), so that the tokenizer,
the config and the weights all come from one snapshot. A speculative draft model is resolved by
the same function, in the worker that loads it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from runtime.config import EngineConfig
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource, load_config, resolve_model
from runtime.models.registry import choose_model
from runtime.plugins.interfaces import Platform
from runtime.pooling.models import resolve_runner


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    hf_config: Any
    runner: str  # "generate" or "pooling"
    model_config: ModelConfig  # its dtype: the one asked for, None for the platform's default

    @classmethod
    def resolve(cls, config: EngineConfig) -> "ModelSpec":
        """Find the model `config` names (nothing is downloaded), read its config and choose
        its implementation; raises ValueError saying what is wrong."""
        source = resolve_model(config.model, config.tokenizer, config.revision,
                               config.download_dir)
        hf_config = load_config(source, config.trust_remote_code)
        runner = resolve_runner(config.runner, source, hf_config)
        # the architecture is checked first, so an unsupported config fails with one line
        # that names what is supported, whatever fields it lacks
        choice = choose_model(getattr(hf_config, "architectures", None), config.model_impl,
                              hf_config)
        model_config = ModelConfig.from_hf(
            hf_config, choice, config.dtype, config.max_model_len,
            config.tensor_parallel_size * config.pipeline_parallel_size)
        return cls(source, hf_config, runner, model_config)

    @classmethod
    def resolve_draft(cls, model: str, target: EngineConfig, dtype: torch.dtype) -> "ModelSpec":
        """A speculative draft model: looked for where the target's model id would be (its
        download dir), read as trustingly, run in the target's dtype on one rank."""
        return cls.resolve(EngineConfig(model=model, dtype=dtype, runner="generate",
                                        download_dir=target.download_dir,
                                        trust_remote_code=target.trust_remote_code))

    @property
    def pools(self) -> bool:
        return self.runner == "pooling"

    def on(self, platform: Platform) -> ModelConfig:
        """The model config with the dtype it runs in on `platform` (the one asked for, else
        the platform's default); raises ValueError when the platform cannot run it."""
        dtype: torch.dtype = self.model_config.dtype or platform.default_dtype()
        if dtype not in platform.supported_dtypes():
            raise ValueError(f"dtype {dtype} is not supported on {platform.name}; "
                             f"supported: {platform.supported_dtypes()}")
        return dataclasses.replace(self.model_config, dtype=dtype)

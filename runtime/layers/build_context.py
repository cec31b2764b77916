"""What the layers of a model need to know when they are built."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from runtime.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from runtime.distributed.pipeline import PipelineStage


@dataclass
class BuildContext:
    """Handed to every model constructor; layers take from it what they need.

    `attention_backend` is the class chosen by the `runtime_attention_backend` hook;
    `custom_op(name)` asks `custom_op_provider` (a worker's `PlatformAnswers.custom_op`, which
    asks the `runtime_custom_op` hook and composes composite ops) once per op name;
    `tp_rank`/`tp_size` and `tp_group` (a `runtime.plugins.interfaces.Communicator`) shard the layers;
    `ep_size` > 1 (expert parallel: the tensor-parallel group's size) gives each rank whole MoE
    experts instead of a slice of every expert;
    `dcp_group` (None: off) is the decode-context-parallel group: attention layers keep
    their shard of every context and merge the group's partial outputs;
    `pp` says which layers this pipeline stage builds and how it reaches its neighbours;
    `encoder_attention_backend` runs a vision encoder's bidirectional prefill-only attention
    (chosen for the encoder's shapes, with `ModelInfo.pooling` set);
    `max_model_len` is the engine's (rotary caches cover it; None: the config's
    max_position_embeddings).
    """

    dtype: torch.dtype
    device: torch.device
    attention_backend: type
    quant_config: QuantizationConfig | None = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    ep_size: int = 1
    dcp_group: Any = None
    pp: PipelineStage = field(default_factory=PipelineStage)
    custom_op_provider: Callable[[str], Callable | None] | None = None
    max_model_len: int | None = None
    encoder_attention_backend: type | None = None
    _custom_ops: dict[str, Callable | None] = field(default_factory=dict)

    def linear_method(self, prefix: str) -> LinearMethod:
        if self.quant_config is None:
            return UnquantizedLinearMethod(self.custom_op("linear"))
        return self.quant_config.linear_method(prefix)

    def custom_op(self, name: str) -> Callable | None:
        """A plugin's replacement for the op `name`, or None for the portable one."""
        if name not in self._custom_ops:
            provider = self.custom_op_provider
            self._custom_ops[name] = provider(name) if provider else None
        return self._custom_ops[name]

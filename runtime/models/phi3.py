"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama layers, loaded from checkpoints that store
the Q/K/V and gate/up projections fused (`qkv_proj`, `gate_up_proj`). The fused tensors are
split back into their parts on the way in, so sharding and quantization see the same parts as
for Llama. LongRoPE (`rope_type` "longrope", formerly "su") comes from the shared rotary layer."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from runtime.model_config import attention_heads
from runtime.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        num_heads, num_kv_heads, head_size = attention_heads(self.config)
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes, 0)):
                    yield name.replace("qkv_proj", part), piece
            elif ".gate_up_proj." in name:
                for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2, 0)):
                    yield name.replace("gate_up_proj", part), piece
            else:
                yield name, tensor

"""Mamba 2: the Mamba stack (runtime.models.mamba) of Mamba 2 mixers; names as transformers'
`Mamba2ForCausalLM`."""
from __future__ import annotations

from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.models.mamba import MambaForCausalLM


class Mamba2ForCausalLM(MambaForCausalLM):
    name = "Mamba 2"

    def build_mixer(self, config, ctx: BuildContext, prefix: str) -> nn.Module:
        return Mamba2Mixer(
            ctx, prefix, hidden_size=config.hidden_size, num_heads=config.num_heads,
            head_dim=config.head_dim, n_groups=config.n_groups, state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            intermediate_size=int(config.expand * config.hidden_size),
            use_conv_bias=config.use_conv_bias, use_bias=config.use_bias,
            eps=config.layer_norm_epsilon, chunk_size=config.chunk_size,
            time_step_limit=config.time_step_limit)

"""GGUF files of Falcon-H1 (llama.cpp's `falcon-h1`): the config and tensor names.

convert_hf_to_gguf.py's FalconH1Model multiplies every muP multiplier into the weights (the
embedding, attention in/out and key, the mixer's input and the five parts of `in_proj`, its
output, the MLP's gate and down projections, lm_head) and writes none of them, so the config
here has each at 1. Falcon-H1's rope is NeoX-style, so q/k rows are written as transformers
keeps them (no llama permutation to undo). llama.cpp gates the scan's output before the grouped
norm whatever `mamba_norm_before_gate` said, and the file runs that way here.
"""
from __future__ import annotations

from typing import Any, Callable

import gguf
from transformers import FalconH1Config

LLM, Attn, Rope, SSM = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.SSM

# the config's multipliers, each folded into the weights by the converter
FOLDED_MULTIPLIERS = dict(
    embedding_multiplier=1.0, lm_head_multiplier=1.0, key_multiplier=1.0,
    attention_in_multiplier=1.0, attention_out_multiplier=1.0, ssm_in_multiplier=1.0,
    ssm_out_multiplier=1.0, mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5)


# GGUF layer tensor -> transformers name in `model.layers.{i}`, beside gguf_hybrid's Mamba 2 mixer
FALCON_H1_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm": "pre_ff_layernorm.weight",  # gguf-py maps pre_ff_layernorm.weight whole
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
}
FALCON_H1_TOP = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.final_layernorm.weight",
                 "output.weight": "lm_head.weight"}


def falcon_h1_config(fields: Any, common: dict[str, Any], has_layer_tensor: Callable[[str], bool]
                     ) -> FalconH1Config:
    """Falcon-H1's config from `fields` (gguf_hybrid._Fields), the keys every hybrid shares
    (`common`) and whether some layer holds a tensor named `blk.{i}.<suffix>`."""
    inner, heads = fields[SSM.INNER_SIZE], fields[SSM.TIME_STEP_RANK]
    kv_heads = fields[Attn.HEAD_COUNT_KV]
    if isinstance(kv_heads, list):  # the converter writes one count; a list must be uniform
        if len(set(kv_heads)) != 1:
            raise NotImplementedError(f"GGUF falcon-h1 with per-layer KV heads {kv_heads} is "
                                      "not supported (every Falcon-H1 layer has attention)")
        kv_heads = kv_heads[0]
    return FalconH1Config(
        **common, **FOLDED_MULTIPLIERS,
        num_attention_heads=fields[Attn.HEAD_COUNT], num_key_value_heads=kv_heads,
        head_dim=fields[Attn.KEY_LENGTH], intermediate_size=fields[LLM.FEED_FORWARD_LENGTH],
        max_position_embeddings=fields[LLM.CONTEXT_LENGTH],
        rms_norm_eps=fields[Attn.LAYERNORM_RMS_EPS],
        rope_parameters={"rope_type": "default", "rope_theta": fields[Rope.FREQ_BASE]},
        mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
        mamba_n_groups=fields[SSM.GROUP_COUNT], mamba_d_state=fields[SSM.STATE_SIZE],
        mamba_d_conv=fields[SSM.CONV_KERNEL],
        mamba_conv_bias=has_layer_tensor("ssm_conv1d.bias"),
        mamba_proj_bias=has_layer_tensor("ssm_in.bias"),
        mamba_rms_norm=has_layer_tensor("ssm_norm.weight"), mamba_norm_before_gate=False)


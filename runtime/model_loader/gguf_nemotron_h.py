"""GGUF files of Nemotron-H (`nemotron_h`, and `nemotron_h_moe` with experts): the config and
the tensor names beside gguf_hybrid's Mamba 2 mixer.

convert_hf_to_gguf.py's NemotronHModel runs GraniteHybridModel's steps: the mixer's as Mamba 2's
(A stored as -exp(A_log) and A, D as [heads, 1], the conv squeezed, the gated norm as
[groups, d_inner / groups]) and the attention q/k rows permuted as for llama, though no rope
turns them. Its keys say per layer what the layer is (KV heads for attention, an FFN length
for the MLPs and experts); the tensors say the same, and the layer types are read from them.
It writes `layer_norm_epsilon` as `attention.layer_norm_epsilon` (the norms are RMSNorms).
The experts (squared ReLU, no gate) are stacked up and down projections, as the native model
keeps them; the router's correction bias is `exp_probs_b`, the latent projections of
Nemotron 3 `ffn_latent_down` / `ffn_latent_up`.
"""
from __future__ import annotations

from typing import Any, Callable

import gguf
from transformers import NemotronHConfig

from runtime.model_loader.gguf_tensor import HybridTensor

LLM, Attn, SSM = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.SSM

# GGUF layer tensor -> where it goes in `backbone.layers.{i}`, beside the Mamba 2 mixer
NEMOTRON_H_LAYER = {
    "attn_norm.weight": HybridTensor("norm.weight"),
    "attn_q.weight": HybridTensor("mixer.q_proj.weight", transform="permute_q"),
    "attn_k.weight": HybridTensor("mixer.k_proj.weight", transform="permute_k"),
    "attn_v.weight": HybridTensor("mixer.v_proj.weight"),
    "attn_output.weight": HybridTensor("mixer.o_proj.weight"),
    "ffn_up.weight": HybridTensor("mixer.up_proj.weight"),
    "ffn_down.weight": HybridTensor("mixer.down_proj.weight"),
    "ffn_gate_inp.weight": HybridTensor("mixer.gate.weight"),
    "exp_probs_b.bias": HybridTensor("mixer.gate.e_score_correction_bias"),
    "ffn_up_exps.weight": HybridTensor("mixer.experts.up_proj"),
    "ffn_down_exps.weight": HybridTensor("mixer.experts.down_proj"),
    "ffn_up_shexp.weight": HybridTensor("mixer.shared_experts.up_proj.weight"),
    "ffn_down_shexp.weight": HybridTensor("mixer.shared_experts.down_proj.weight"),
    "ffn_latent_down.weight": HybridTensor("mixer.fc1_latent_proj.weight"),
    "ffn_latent_up.weight": HybridTensor("mixer.fc2_latent_proj.weight"),
}

# the layer's type by the tensor only it has
_LAYER_MARKS = (("ssm_in.weight", "linear_attention"), ("attn_q.weight", "full_attention"),
                ("ffn_gate_inp.weight", "moe"), ("ffn_up.weight", "mlp"))


def nemotron_h_config(fields: Any, common: dict[str, Any], names: set[str],
                      has_layer_tensor: Callable[[str], bool]) -> NemotronHConfig:
    """Nemotron-H's config from `fields` (gguf_hybrid._Fields), the keys every hybrid shares
    (`common`), the file's tensor names and whether some layer holds `blk.{i}.<suffix>`."""
    layer_types = []
    for i in range(common["num_hidden_layers"]):
        kind = next((kind for mark, kind in _LAYER_MARKS if f"blk.{i}.{mark}" in names), None)
        if kind is None:
            raise ValueError(f"GGUF nemotron_h: layer {i} has no mixer, attention or FFN")
        layer_types.append(kind)
    inner, heads = fields[SSM.INNER_SIZE], fields[SSM.TIME_STEP_RANK]
    kv_heads, ffn = fields[Attn.HEAD_COUNT_KV], fields[LLM.FEED_FORWARD_LENGTH]
    config = dict(
        **common, layer_types=layer_types, num_attention_heads=fields[Attn.HEAD_COUNT],
        num_key_value_heads=max(kv_heads) if isinstance(kv_heads, list) else kv_heads,
        head_dim=fields[Attn.KEY_LENGTH], max_position_embeddings=fields[LLM.CONTEXT_LENGTH],
        intermediate_size=max(ffn) if isinstance(ffn, list) else ffn,
        layer_norm_epsilon=fields.get(Attn.LAYERNORM_RMS_EPS, None) or
        fields[Attn.LAYERNORM_EPS],
        mamba_num_heads=heads, mamba_head_dim=inner // heads, n_groups=fields[SSM.GROUP_COUNT],
        ssm_state_size=fields[SSM.STATE_SIZE], conv_kernel=fields[SSM.CONV_KERNEL],
        use_conv_bias=has_layer_tensor("ssm_conv1d.bias"),
        use_bias=has_layer_tensor("ssm_in.bias"))
    if "moe" in layer_types:
        config.update(
            n_routed_experts=fields[LLM.EXPERT_COUNT],
            num_experts_per_tok=fields[LLM.EXPERT_USED_COUNT],
            moe_intermediate_size=fields[LLM.EXPERT_FEED_FORWARD_LENGTH],
            moe_shared_expert_intermediate_size=fields[LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH],
            n_shared_experts=fields.get(LLM.EXPERT_SHARED_COUNT, 1),
            norm_topk_prob=bool(fields.get(LLM.EXPERT_WEIGHTS_NORM, False)),
            routed_scaling_factor=fields.get(LLM.EXPERT_WEIGHTS_SCALE, 1.0),
            n_group=fields.get(LLM.EXPERT_GROUP_COUNT, 1),
            topk_group=fields.get(LLM.EXPERT_GROUP_USED_COUNT, 1),
            moe_latent_size=fields.get(LLM.MOE_LATENT_SIZE, None))
    return NemotronHConfig(**config)

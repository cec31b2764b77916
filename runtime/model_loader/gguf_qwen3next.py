"""GGUF files of Qwen3-Next (`qwen3next`): their config and tensor names.

What convert_hf_to_gguf.py's Qwen3NextModel did, undone on load into the native model:
- A stored as -exp(A_log), the conv weight squeezed to [channels, width], `dt_bias` renamed;
- the zero-centred RMSNorm weights (all but the delta-net's gated norm) stored as 1 + w;
- `in_proj_qkvz` ([q, k, v, z] per key-head group) regrouped into `attn_qkv` (all q, all k,
  all v) and `attn_gate` (all z): exactly Qwen3.5's `in_proj_qkv` and `in_proj_z`, which the
  native model loads as they are;
- the experts stacked, the shared expert and its gate renamed. `in_proj_ba` and the gated
  attention's fused q + gate rows are stored as they are.
The layer types come from the full-attention interval. llama.cpp names no dense FFN for
qwen3next, so every layer of a file has experts (the converter fails on `mlp_only_layers`).
"""
from __future__ import annotations

import gguf
from transformers import PretrainedConfig, Qwen3NextConfig

from runtime.model_loader.gguf_tensor import HybridTensor

LLM, Attn, Rope, SSM = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.SSM

QWEN3NEXT_TOP = {
    "token_embd.weight": HybridTensor("model.embed_tokens.weight"),
    "output_norm.weight": HybridTensor("model.norm.weight", transform="minus_one"),
    "output.weight": HybridTensor("lm_head.weight"),
}


def _layer() -> dict[str, HybridTensor]:
    attn, linear, mlp = "self_attn", "linear_attn", "mlp"
    norm = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
            "attn_q_norm": f"{attn}.q_norm", "attn_k_norm": f"{attn}.k_norm"}
    layer = {f"{gguf_name}.weight": HybridTensor(f"{name}.weight", transform="minus_one")
             for gguf_name, name in norm.items()}
    plain = {
        "attn_q.weight": f"{attn}.q_proj.weight", "attn_k.weight": f"{attn}.k_proj.weight",
        "attn_v.weight": f"{attn}.v_proj.weight", "attn_output.weight": f"{attn}.o_proj.weight",
        "attn_qkv.weight": f"{linear}.in_proj_qkv.weight",
        "attn_gate.weight": f"{linear}.in_proj_z.weight",
        "ssm_ba.weight": f"{linear}.in_proj_ba.weight", "ssm_dt.bias": f"{linear}.dt_bias",
        "ssm_norm.weight": f"{linear}.norm.weight", "ssm_out.weight": f"{linear}.out_proj.weight",
        "ffn_gate_inp.weight": f"{mlp}.gate.weight",
        # stacked [experts, out, in], which the loader hands out one expert at a time
        "ffn_gate_exps.weight": f"{mlp}.experts.gate_proj.weight",
        "ffn_up_exps.weight": f"{mlp}.experts.up_proj.weight",
        "ffn_down_exps.weight": f"{mlp}.experts.down_proj.weight",
        "ffn_gate_shexp.weight": f"{mlp}.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": f"{mlp}.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": f"{mlp}.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight": f"{mlp}.shared_expert_gate.weight",
    }
    layer.update({gguf_name: HybridTensor(name) for gguf_name, name in plain.items()})
    layer.update({
        "ssm_a": HybridTensor(f"{linear}.A_log", transform="a_log"),
        "ssm_conv1d.weight": HybridTensor(f"{linear}.conv1d.weight", "conv"),
    })
    return layer


QWEN3NEXT_LAYER = _layer()


def qwen3next_config(fields, common: dict) -> PretrainedConfig:
    """The Qwen3NextConfig of a `qwen3next` file; `fields` reads its metadata (gguf_hybrid's
    _Fields), `common` holds the keys every hybrid shares."""
    layers, interval = common["num_hidden_layers"], fields[LLM.FULL_ATTENTION_INTERVAL]
    head_dim = fields[Attn.KEY_LENGTH]
    value_heads = fields[SSM.TIME_STEP_RANK]
    return Qwen3NextConfig(
        **common, num_attention_heads=fields[Attn.HEAD_COUNT],
        num_key_value_heads=fields[Attn.HEAD_COUNT_KV], head_dim=head_dim,
        intermediate_size=fields[LLM.FEED_FORWARD_LENGTH],
        max_position_embeddings=fields[LLM.CONTEXT_LENGTH],
        rms_norm_eps=fields[Attn.LAYERNORM_RMS_EPS],
        rope_parameters={"rope_type": "default", "rope_theta": fields[Rope.FREQ_BASE],
                         "partial_rotary_factor": fields[Rope.DIMENSION_COUNT] / head_dim},
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(layers)],
        linear_conv_kernel_dim=fields[SSM.CONV_KERNEL],
        linear_key_head_dim=fields[SSM.STATE_SIZE], linear_num_key_heads=fields[SSM.GROUP_COUNT],
        linear_num_value_heads=value_heads,
        linear_value_head_dim=fields[SSM.INNER_SIZE] // value_heads,
        num_experts=fields[LLM.EXPERT_COUNT], num_experts_per_tok=fields[LLM.EXPERT_USED_COUNT],
        moe_intermediate_size=fields[LLM.EXPERT_FEED_FORWARD_LENGTH],
        shared_expert_intermediate_size=fields[LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH],
        # llama.cpp's qwen3next graph renormalises the top-k router weights, as Qwen3-Next does
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def qwen3next_tensor(gguf_name: str) -> HybridTensor | None:
    """Where `qwen3next` tensor `gguf_name` goes; None if nowhere."""
    if gguf_name in QWEN3NEXT_TOP:
        return QWEN3NEXT_TOP[gguf_name]
    parts = gguf_name.split(".", 2)
    found = QWEN3NEXT_LAYER.get(parts[2]) if len(parts) == 3 and parts[0] == "blk" else None
    if found is None:
        return None
    return HybridTensor(f"model.layers.{parts[1]}.{found.name}", found.reshape, found.transform)

"""GGUF files of Qwen3-Next (`qwen3next`) and Qwen3.5 (`qwen35`, `qwen35moe`): their configs
and tensor names, one table for the three (convert_hf_to_gguf.py's Qwen3_5 models are its
Qwen3NextModel with one more step).

What Qwen3NextModel did, undone on load into the native models:
- A stored as -exp(A_log), the conv weight squeezed to [channels, width], `dt_bias` renamed;
- the zero-centred RMSNorm weights (all but the delta-net's gated norm) stored as 1 + w;
- qwen3next's `in_proj_qkvz` ([q, k, v, z] per key-head group) regrouped into `attn_qkv` (all
  q, all k, all v) and `attn_gate` (all z): exactly Qwen3.5's `in_proj_qkv` and `in_proj_z`,
  which the native models load as they are; its `in_proj_ba` is stored as it is;
- the experts stacked, or with `--fuse-gate-up-exps` gate and up stacked into one
  `ffn_gate_up_exps` [E, 2I, H], transformers' `experts.gate_up_proj` (the MoE loader takes
  it whole); the shared expert and its gate renamed.
Qwen3.5's step (_LinearAttentionVReorderBase), when it has more value heads than key heads: the
value heads of every delta-net tensor go from grouped by key head (value head g * r + j is the
j-th of key head g) to tiled (j * K + g), for ggml's broadcast; `untile_value_heads` puts
them back. Its `in_proj_b` and `in_proj_a` come apart, as `ssm_beta` and `ssm_alpha`.
A layer is gated attention where the file has its `attn_q`, a delta-net elsewhere. llama.cpp
names no dense FFN of qwen3next, so every layer of such a file has experts. Qwen3.5's
multi-token prediction blocks (`nextn_predict_layers`, after the decoder's) are left out.
"""
from __future__ import annotations

from typing import Any

import gguf
import numpy as np
from transformers import PretrainedConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

from runtime.model_loader.gguf_tensor import HybridTensor

LLM, Attn, Rope, SSM = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.SSM

QWEN_ARCHITECTURES = {"qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                      "qwen35moe": "Qwen3_5MoeForCausalLM"}
# `--fuse-gate-up-exps`'s experts, in the checkpoint's name (of what the loader reads, gguf-py
# lists ffn_gate_up_exps for qwen3next and qwen35moe only: the converter fails on the others)
FUSED_EXPERTS = ".experts.gate_up_proj"

_TOP = {
    "token_embd.weight": HybridTensor("model.embed_tokens.weight"),
    "output_norm.weight": HybridTensor("model.norm.weight", transform="minus_one"),
    "output.weight": HybridTensor("lm_head.weight"),
}


def _layer(arch: str) -> dict[str, HybridTensor]:
    attn, linear, mlp = "self_attn", "linear_attn", "mlp"
    norm = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
            "attn_q_norm": f"{attn}.q_norm", "attn_k_norm": f"{attn}.k_norm"}
    layer = {f"{gguf_name}.weight": HybridTensor(f"{name}.weight", transform="minus_one")
             for gguf_name, name in norm.items()}
    plain = {
        "attn_q.weight": f"{attn}.q_proj.weight", "attn_k.weight": f"{attn}.k_proj.weight",
        "attn_v.weight": f"{attn}.v_proj.weight", "attn_output.weight": f"{attn}.o_proj.weight",
        "ssm_norm.weight": f"{linear}.norm.weight",
    }
    if arch == "qwen35":
        plain.update({"ffn_gate.weight": f"{mlp}.gate_proj.weight",
                      "ffn_up.weight": f"{mlp}.up_proj.weight",
                      "ffn_down.weight": f"{mlp}.down_proj.weight"})
    else:
        plain.update({
            "ffn_gate_inp.weight": f"{mlp}.gate.weight",
            # stacked [experts, out, in], which the loader hands out one expert at a time
            "ffn_gate_exps.weight": f"{mlp}.experts.gate_proj.weight",
            "ffn_up_exps.weight": f"{mlp}.experts.up_proj.weight",
            "ffn_down_exps.weight": f"{mlp}.experts.down_proj.weight",
            "ffn_gate_up_exps.weight": f"{mlp}{FUSED_EXPERTS}",
            "ffn_gate_shexp.weight": f"{mlp}.shared_expert.gate_proj.weight",
            "ffn_up_shexp.weight": f"{mlp}.shared_expert.up_proj.weight",
            "ffn_down_shexp.weight": f"{mlp}.shared_expert.down_proj.weight",
            "ffn_gate_inp_shexp.weight": f"{mlp}.shared_expert_gate.weight",
        })
    layer.update({gguf_name: HybridTensor(name) for gguf_name, name in plain.items()})
    # the delta-net's tensors; Qwen3.5's with their value heads tiled (transform "v_heads_*")
    qwen35 = arch != "qwen3next"
    tiled = {
        "attn_qkv.weight": (f"{linear}.in_proj_qkv.weight", None, "v_heads_qkv"),
        "attn_gate.weight": (f"{linear}.in_proj_z.weight", None, "v_heads_rows"),
        "ssm_dt.bias": (f"{linear}.dt_bias", None, "v_heads_scalars"),
        "ssm_out.weight": (f"{linear}.out_proj.weight", None, "v_heads_columns"),
        "ssm_a": (f"{linear}.A_log", None, "a_log+v_heads_scalars"),
        "ssm_conv1d.weight": (f"{linear}.conv1d.weight", "conv", "v_heads_qkv"),
    }
    if qwen35:
        tiled.update({"ssm_beta.weight": (f"{linear}.in_proj_b.weight", None, "v_heads_scalars"),
                      "ssm_alpha.weight": (f"{linear}.in_proj_a.weight", None, "v_heads_scalars")})
    else:
        layer["ssm_ba.weight"] = HybridTensor(f"{linear}.in_proj_ba.weight")
    for gguf_name, (name, reshape, transform) in tiled.items():
        if not qwen35:
            transform = "a_log" if transform.startswith("a_log") else None
        layer[gguf_name] = HybridTensor(name, reshape, transform)
    return layer


_LAYERS = {arch: _layer(arch) for arch in QWEN_ARCHITECTURES}


def qwen_config(fields: Any, common: dict[str, Any], names: set[str], arch: str
                ) -> PretrainedConfig:
    """The config of a `qwen3next`, `qwen35` or `qwen35moe` file; `fields` reads its metadata
    (gguf_hybrid's _Fields), `common` holds the keys every hybrid shares, `names` the file's
    tensor names."""
    # the multi-token prediction blocks come after the decoder's (`block_count` holds both);
    # they are not loaded (gguf_loader skips blocks past the config's layers)
    layers = common["num_hidden_layers"] - fields.get(LLM.NEXTN_PREDICT_LAYERS, 0)
    common = {**common, "num_hidden_layers": layers}
    head_dim = fields[Attn.KEY_LENGTH]
    value_heads = fields[SSM.TIME_STEP_RANK]
    # Qwen3.5's mrope sections (`rope.dimension_sections`) rotate text, whose three position
    # streams are one, as plain rope does
    rope = {"rope_type": "default", "rope_theta": fields[Rope.FREQ_BASE],
            "partial_rotary_factor": fields[Rope.DIMENSION_COUNT] / head_dim}
    kwargs = dict(
        **common, num_attention_heads=fields[Attn.HEAD_COUNT],
        num_key_value_heads=fields[Attn.HEAD_COUNT_KV], head_dim=head_dim,
        max_position_embeddings=fields[LLM.CONTEXT_LENGTH],
        rms_norm_eps=fields[Attn.LAYERNORM_RMS_EPS], rope_parameters=rope,
        layer_types=["full_attention" if f"blk.{i}.attn_q.weight" in names
                     else "linear_attention" for i in range(layers)],
        linear_conv_kernel_dim=fields[SSM.CONV_KERNEL],
        linear_key_head_dim=fields[SSM.STATE_SIZE], linear_num_key_heads=fields[SSM.GROUP_COUNT],
        linear_num_value_heads=value_heads,
        linear_value_head_dim=fields[SSM.INNER_SIZE] // value_heads)
    if arch == "qwen35":
        return Qwen3_5TextConfig(**kwargs, intermediate_size=fields[LLM.FEED_FORWARD_LENGTH])
    # llama.cpp's graphs of both renormalise the top-k router weights, as both models do
    kwargs.update(
        num_experts=fields[LLM.EXPERT_COUNT], num_experts_per_tok=fields[LLM.EXPERT_USED_COUNT],
        moe_intermediate_size=fields[LLM.EXPERT_FEED_FORWARD_LENGTH],
        shared_expert_intermediate_size=fields[LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH])
    if arch == "qwen35moe":
        return Qwen3_5MoeTextConfig(**kwargs)
    return Qwen3NextConfig(**kwargs, intermediate_size=fields[LLM.FEED_FORWARD_LENGTH],
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def qwen_tensor(gguf_name: str, arch: str) -> HybridTensor | None:
    """Where tensor `gguf_name` of a Qwen3-Next or Qwen3.5 file goes; None if nowhere."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".", 2)
    found = _LAYERS[arch].get(parts[2]) if len(parts) == 3 and parts[0] == "blk" else None
    if found is None:
        return None
    return HybridTensor(f"model.layers.{parts[1]}.{found.name}", found.reshape, found.transform)


def untile_value_heads(weight: np.ndarray, part: str, config: PretrainedConfig) -> np.ndarray:
    """Put Qwen3.5's delta-net value heads back in transformers' order (grouped by key head)
    from the converter's tiled order. `part` says where they lie: "qkv" (the rows after all
    q and k, also the conv's channels), "rows" (rows, a value head's width each), "scalars"
    (one row or element per value head), "columns" (out_proj's columns)."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if key_heads == value_heads:  # the converter reorders nothing then
        return weight
    width = 1 if part == "scalars" else config.linear_value_head_dim
    start = 2 * key_heads * config.linear_key_head_dim if part == "qkv" else 0
    moved = np.moveaxis(weight, 1 if part == "columns" else 0, 0)
    heads = moved[start:]
    # tiled [r, K, width] -> grouped [K, r, width]
    heads = heads.reshape(value_heads // key_heads, key_heads, width, *heads.shape[1:])
    heads = heads.swapaxes(0, 1).reshape(-1, *moved.shape[1:])
    untiled = np.concatenate([moved[:start], heads])
    return np.moveaxis(untiled, 0, 1 if part == "columns" else 0)

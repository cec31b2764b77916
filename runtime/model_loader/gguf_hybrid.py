"""GGUF files of the state-space and hybrid architectures: their configs and tensor names
(Qwen3-Next's and Qwen3.5's in gguf_qwen3next.py).

transformers reads no GGUF config of Mamba 2 or Granite 4.0-H, so each config here is rebuilt
from llama.cpp's metadata keys. Each GGUF tensor maps to a checkpoint parameter of the
transformers model, with what convert_hf_to_gguf.py did to it undone: Mamba's A stored as
-exp(A_log), conv weights squeezed to [channels, width], Mamba 2's A, D and grouped norm
reshaped, Granite's and Jamba's fused gate/up projections split in two (`merge` joins them
again) and Granite's attention q/k rows permuted as for llama. Jamba's attention and expert
layers, which its config places by offset and period, the file marks per layer (a KV head count,
a router tensor). Falcon-H1's and Nemotron-H's configs and layer names are
gguf_falcon_h1.py's and gguf_nemotron_h.py's.
"""
from __future__ import annotations

from typing import Any

import gguf
from transformers import (
    GraniteMoeHybridConfig,
    JambaConfig,
    Lfm2Config,
    Mamba2Config,
    MambaConfig,
    PretrainedConfig,
)

from runtime.model_loader.gguf_falcon_h1 import FALCON_H1_LAYER, FALCON_H1_TOP, falcon_h1_config
from runtime.model_loader.gguf_nemotron_h import NEMOTRON_H_LAYER, nemotron_h_config
from runtime.model_loader.gguf_qwen3next import QWEN_ARCHITECTURES, qwen_config, qwen_tensor
from runtime.model_loader.gguf_tensor import HybridTensor

HYBRID_ARCHITECTURES = {"mamba2": "Mamba2ForCausalLM", "granitehybrid": "GraniteMoeHybridForCausalLM",
                        "lfm2": "Lfm2ForCausalLM", "mamba": "MambaForCausalLM",
                        "jamba": "JambaForCausalLM", "falcon-h1": "FalconH1ForCausalLM",
                        "nemotron_h": "NemotronHForCausalLM",
                        "nemotron_h_moe": "NemotronHForCausalLM", **QWEN_ARCHITECTURES}

Keys, LLM, Attn, Rope, SSM = gguf.Keys, gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.SSM


def hybrid_config(reader: gguf.GGUFReader, arch: str) -> PretrainedConfig:
    """The transformers config of a hybrid GGUF file, from llama.cpp's metadata keys."""
    fields = _Fields(reader, arch)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    common = dict(
        vocab_size=int(embd.shape[1]), hidden_size=fields[LLM.EMBEDDING_LENGTH],
        num_hidden_layers=fields[LLM.BLOCK_COUNT],
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        architectures=[HYBRID_ARCHITECTURES[arch]], **_token_ids(reader))
    names = {t.name for t in reader.tensors}
    if arch in QWEN_ARCHITECTURES:
        return qwen_config(fields, common, names, arch)
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return nemotron_h_config(fields, common, names, lambda suffix: _any_layer(names, suffix))
    if arch == "mamba":
        if fields.get(SSM.DT_B_C_RMS, False):
            raise NotImplementedError("GGUF mamba with dt/B/C norms (Falcon Mamba) is not supported")
        return MambaConfig(
            **common, state_size=fields[SSM.STATE_SIZE], conv_kernel=fields[SSM.CONV_KERNEL],
            expand=fields[SSM.INNER_SIZE] // fields[LLM.EMBEDDING_LENGTH],
            time_step_rank=fields[SSM.TIME_STEP_RANK],
            layer_norm_epsilon=fields[Attn.LAYERNORM_RMS_EPS],
            use_bias="blk.0.ssm_in.bias" in names, use_conv_bias="blk.0.ssm_conv1d.bias" in names)
    if arch == "mamba2":
        inner, heads = fields[SSM.INNER_SIZE], fields[SSM.TIME_STEP_RANK]
        return Mamba2Config(
            **common, num_heads=heads, head_dim=inner // heads, state_size=fields[SSM.STATE_SIZE],
            n_groups=fields[SSM.GROUP_COUNT], conv_kernel=fields[SSM.CONV_KERNEL],
            expand=inner // fields[LLM.EMBEDDING_LENGTH],
            layer_norm_epsilon=fields[Attn.LAYERNORM_RMS_EPS],
            use_bias="blk.0.ssm_in.bias" in names, use_conv_bias="blk.0.ssm_conv1d.bias" in names)
    kv_heads = fields[Attn.HEAD_COUNT_KV]
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * common["num_hidden_layers"]
    attention = dict(num_attention_heads=fields[Attn.HEAD_COUNT], num_key_value_heads=max(kv_heads),
                     intermediate_size=fields[LLM.FEED_FORWARD_LENGTH],
                     max_position_embeddings=fields[LLM.CONTEXT_LENGTH])
    if arch == "lfm2":
        return Lfm2Config(
            **common, **attention, norm_eps=fields[Attn.LAYERNORM_RMS_EPS],
            rope_parameters={"rope_type": "default", "rope_theta": fields[Rope.FREQ_BASE]},
            conv_L_cache=fields[Keys.ShortConv.L_CACHE], block_auto_adjust_ff_dim=False,
            conv_bias=_any_layer(names, "shortconv.conv.bias"),
            layer_types=["full_attention" if n else "conv" for n in kv_heads])
    if arch == "falcon-h1":
        return falcon_h1_config(fields, common, lambda suffix: _any_layer(names, suffix))
    if arch == "jamba":
        layers = common["num_hidden_layers"]
        attn_offset, attn_period = _offset_period([i for i, n in enumerate(kv_heads) if n],
                                                  layers, "attention")
        expert_offset, expert_period = _offset_period(
            [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names], layers, "MoE")
        return JambaConfig(
            **common, **attention, rms_norm_eps=fields[Attn.LAYERNORM_RMS_EPS],
            num_experts=fields[LLM.EXPERT_COUNT], num_experts_per_tok=fields[LLM.EXPERT_USED_COUNT],
            attn_layer_offset=attn_offset, attn_layer_period=attn_period,
            expert_layer_offset=expert_offset, expert_layer_period=expert_period,
            mamba_d_state=fields[SSM.STATE_SIZE], mamba_d_conv=fields[SSM.CONV_KERNEL],
            mamba_expand=fields[SSM.INNER_SIZE] // fields[LLM.EMBEDDING_LENGTH],
            mamba_dt_rank=fields[SSM.TIME_STEP_RANK],
            mamba_conv_bias=_any_layer(names, "ssm_conv1d.bias"),
            mamba_proj_bias=_any_layer(names, "ssm_in.bias"))
    if fields.get(Rope.SCALING_FINETUNED, False):
        # the converter's mark of a Bamba checkpoint (attention with rope, a plain MLP)
        raise NotImplementedError("GGUF granitehybrid with rope (converted from Bamba) is not "
                                  "supported; run the Bamba checkpoint from its folder")
    inner, heads = fields[SSM.INNER_SIZE], fields[SSM.TIME_STEP_RANK]
    experts = fields.get(LLM.EXPERT_COUNT, 0)
    scales = {"embedding_multiplier": LLM.EMBEDDING_SCALE, "residual_multiplier": LLM.RESIDUAL_SCALE,
              "attention_multiplier": Attn.SCALE, "logits_scaling": LLM.LOGIT_SCALE}
    return GraniteMoeHybridConfig(
        **common, **attention, rms_norm_eps=fields[Attn.LAYERNORM_RMS_EPS],
        **{key: fields[name] for key, name in scales.items() if name in fields},
        num_local_experts=experts, num_experts_per_tok=fields.get(LLM.EXPERT_USED_COUNT, 0),
        shared_intermediate_size=fields.get(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
                                            fields[LLM.FEED_FORWARD_LENGTH]),
        layer_types=["attention" if n else "mamba" for n in kv_heads],
        mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_n_groups=fields[SSM.GROUP_COUNT],
        mamba_d_state=fields[SSM.STATE_SIZE], mamba_d_conv=fields[SSM.CONV_KERNEL],
        mamba_expand=inner // fields[LLM.EMBEDDING_LENGTH],
        mamba_conv_bias=_any_layer(names, "ssm_conv1d.bias"),
        mamba_proj_bias=_any_layer(names, "ssm_in.bias"))


def hybrid_tensor(gguf_name: str, arch: str) -> HybridTensor | None:
    """Where GGUF tensor `gguf_name` of architecture `arch` goes; None if nowhere."""
    if arch in QWEN_ARCHITECTURES:
        return qwen_tensor(gguf_name, arch)
    top = _TOP[arch].get(gguf_name)
    if top is not None:
        return HybridTensor(top)
    parts = gguf_name.split(".", 2)
    if len(parts) < 3 or parts[0] != "blk":
        return None
    _, layer, rest = parts
    found = _LAYER[arch].get(rest)
    if found is None:
        return None
    return HybridTensor(f"{_LAYER_PREFIX[arch]}.{layer}.{found.name}", found.reshape,
                        found.transform, found.merge)


def _mixer(prefix: str, mamba2: bool) -> dict[str, HybridTensor]:
    flat = "flat" if mamba2 else None  # Mamba 2's A and D came out as [H, 1], its norm as [G, D/G]
    mixer = {
        "ssm_in.weight": HybridTensor(f"{prefix}.in_proj.weight"),
        "ssm_in.bias": HybridTensor(f"{prefix}.in_proj.bias"),
        "ssm_conv1d.weight": HybridTensor(f"{prefix}.conv1d.weight", "conv"),
        "ssm_conv1d.bias": HybridTensor(f"{prefix}.conv1d.bias"),
        "ssm_a": HybridTensor(f"{prefix}.A_log", flat, "a_log"),
        "ssm_d": HybridTensor(f"{prefix}.D", flat),
        "ssm_out.weight": HybridTensor(f"{prefix}.out_proj.weight"),
    }
    if mamba2:
        mixer["ssm_dt.bias"] = HybridTensor(f"{prefix}.dt_bias")
        mixer["ssm_norm.weight"] = HybridTensor(f"{prefix}.norm.weight", "flat")
    else:
        mixer["ssm_x.weight"] = HybridTensor(f"{prefix}.x_proj.weight")
        mixer["ssm_dt.weight"] = HybridTensor(f"{prefix}.dt_proj.weight")
        mixer["ssm_dt.bias"] = HybridTensor(f"{prefix}.dt_proj.bias")
    return mixer


def _granite_layer() -> dict[str, HybridTensor]:
    moe, shared = "block_sparse_moe", "shared_mlp"
    layer = _mixer("mamba", True)
    layer.update({
        "attn_norm.weight": HybridTensor("input_layernorm.weight"),
        "ffn_norm.weight": HybridTensor("post_attention_layernorm.weight"),
        "attn_q.weight": HybridTensor("self_attn.q_proj.weight", transform="permute_q"),
        "attn_k.weight": HybridTensor("self_attn.k_proj.weight", transform="permute_k"),
        "attn_v.weight": HybridTensor("self_attn.v_proj.weight"),
        "attn_output.weight": HybridTensor("self_attn.o_proj.weight"),
        "ffn_gate_inp.weight": HybridTensor(f"{moe}.router.layer.weight"),
        "ffn_gate_exps.weight": HybridTensor(f"{moe}.input_linear.weight", merge=(0, 2, 1)),
        "ffn_up_exps.weight": HybridTensor(f"{moe}.input_linear.weight", merge=(1, 2, 1)),
        "ffn_down_exps.weight": HybridTensor(f"{moe}.output_linear.weight"),
    })
    # the shared MLP, named as a shared expert beside experts and as the FFN without them
    for gate, up, down in (("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"),
                           ("ffn_gate", "ffn_up", "ffn_down")):
        layer[f"{gate}.weight"] = HybridTensor(f"{shared}.input_linear.weight", merge=(0, 2, 0))
        layer[f"{up}.weight"] = HybridTensor(f"{shared}.input_linear.weight", merge=(1, 2, 0))
        layer[f"{down}.weight"] = HybridTensor(f"{shared}.output_linear.weight")
    return layer


def _jamba_layer() -> dict[str, HybridTensor]:
    ffn = "feed_forward"
    layer = _mixer("mamba", False)
    layer.update({
        "ssm_dt_norm.weight": HybridTensor("mamba.dt_layernorm.weight"),
        "ssm_b_norm.weight": HybridTensor("mamba.b_layernorm.weight"),
        "ssm_c_norm.weight": HybridTensor("mamba.c_layernorm.weight"),
        "attn_norm.weight": HybridTensor("input_layernorm.weight"),
        "ffn_norm.weight": HybridTensor("pre_ff_layernorm.weight"),
        "attn_q.weight": HybridTensor("self_attn.q_proj.weight"),
        "attn_k.weight": HybridTensor("self_attn.k_proj.weight"),
        "attn_v.weight": HybridTensor("self_attn.v_proj.weight"),
        "attn_output.weight": HybridTensor("self_attn.o_proj.weight"),
        "ffn_gate.weight": HybridTensor(f"{ffn}.gate_proj.weight"),
        "ffn_up.weight": HybridTensor(f"{ffn}.up_proj.weight"),
        "ffn_down.weight": HybridTensor(f"{ffn}.down_proj.weight"),
        "ffn_gate_inp.weight": HybridTensor(f"{ffn}.router.weight"),
        "ffn_gate_exps.weight": HybridTensor(f"{ffn}.experts.gate_up_proj", merge=(0, 2, 1)),
        "ffn_up_exps.weight": HybridTensor(f"{ffn}.experts.gate_up_proj", merge=(1, 2, 1)),
        "ffn_down_exps.weight": HybridTensor(f"{ffn}.experts.down_proj"),
    })
    return layer


_LFM2_LAYER = {
    "attn_norm.weight": HybridTensor("operator_norm.weight"),
    "ffn_norm.weight": HybridTensor("ffn_norm.weight"),
    "ffn_gate.weight": HybridTensor("feed_forward.w1.weight"),
    "ffn_up.weight": HybridTensor("feed_forward.w3.weight"),
    "ffn_down.weight": HybridTensor("feed_forward.w2.weight"),
    "shortconv.conv.weight": HybridTensor("conv.conv.weight", "conv"),
    "shortconv.conv.bias": HybridTensor("conv.conv.bias"),
    "shortconv.in_proj.weight": HybridTensor("conv.in_proj.weight"),
    "shortconv.in_proj.bias": HybridTensor("conv.in_proj.bias"),
    "shortconv.out_proj.weight": HybridTensor("conv.out_proj.weight"),
    "shortconv.out_proj.bias": HybridTensor("conv.out_proj.bias"),
    "attn_q.weight": HybridTensor("self_attn.q_proj.weight"),
    "attn_k.weight": HybridTensor("self_attn.k_proj.weight"),
    "attn_v.weight": HybridTensor("self_attn.v_proj.weight"),
    "attn_output.weight": HybridTensor("self_attn.out_proj.weight"),
    "attn_q_norm.weight": HybridTensor("self_attn.q_layernorm.weight"),
    "attn_k_norm.weight": HybridTensor("self_attn.k_layernorm.weight"),
}

_BACKBONE_TOP = {"token_embd.weight": "backbone.embeddings.weight",
                 "output_norm.weight": "backbone.norm_f.weight", "output.weight": "lm_head.weight"}
_TOP = {
    "mamba": _BACKBONE_TOP, "mamba2": _BACKBONE_TOP,
    "granitehybrid": {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"},
    # LFM2's final norm is named embedding_norm, and llama.cpp keeps the name
    "lfm2": {"token_embd.weight": "model.embed_tokens.weight",
             "token_embd_norm.weight": "model.embedding_norm.weight", "output.weight": "lm_head.weight"},
    "jamba": {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.final_layernorm.weight",
              "output.weight": "lm_head.weight"},
    "falcon-h1": FALCON_H1_TOP,
    "nemotron_h": _BACKBONE_TOP, "nemotron_h_moe": _BACKBONE_TOP,
}
_LAYER_PREFIX = {"mamba": "backbone.layers", "mamba2": "backbone.layers",
                 "granitehybrid": "model.layers", "lfm2": "model.layers", "jamba": "model.layers",
                 "falcon-h1": "model.layers", "nemotron_h": "backbone.layers",
                 "nemotron_h_moe": "backbone.layers"}
_LAYER = {
    "mamba": {"attn_norm.weight": HybridTensor("norm.weight"), **_mixer("mixer", False)},
    "mamba2": {"attn_norm.weight": HybridTensor("norm.weight"), **_mixer("mixer", True)},
    "granitehybrid": _granite_layer(),
    "lfm2": _LFM2_LAYER,
    "jamba": _jamba_layer(),
    "falcon-h1": {**_mixer("mamba", True),
                  **{key: HybridTensor(name) for key, name in FALCON_H1_LAYER.items()}},
    "nemotron_h": {**_mixer("mixer", True), **NEMOTRON_H_LAYER},
    "nemotron_h_moe": {**_mixer("mixer", True), **NEMOTRON_H_LAYER},
}


class _Fields:
    """The file's metadata by gguf.Keys template (`{arch}` filled in)."""

    def __init__(self, reader: gguf.GGUFReader, arch: str):
        self._fields, self._arch = reader.fields, arch

    def __contains__(self, key: str) -> bool:
        return key.format(arch=self._arch) in self._fields

    def __getitem__(self, key: str) -> Any:
        name = key.format(arch=self._arch)
        if name not in self._fields:
            raise ValueError(f"GGUF {self._arch} file lacks the metadata key {name!r}")
        return self._fields[name].contents()

    def get(self, key: str, default: Any) -> Any:
        name = key.format(arch=self._arch)
        return self._fields[name].contents() if name in self._fields else default


def _token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    keys = {"bos_token_id": Keys.Tokenizer.BOS_ID, "eos_token_id": Keys.Tokenizer.EOS_ID,
            "pad_token_id": Keys.Tokenizer.PAD_ID}
    return {k: reader.fields[key].contents() for k, key in keys.items() if key in reader.fields}


def _any_layer(names: set[str], suffix: str) -> bool:
    return any(n.startswith("blk.") and n.endswith(f".{suffix}") for n in names)


def _offset_period(layers: list[int], count: int, kind: str) -> tuple[int, int]:
    """The (offset, period) of Jamba's config that places its `kind` layers at `layers`."""
    offset = layers[0] if layers else count
    period = layers[1] - layers[0] if len(layers) > 1 else count
    if [i for i in range(offset, count) if (i - offset) % period == 0] != layers:
        raise NotImplementedError(f"GGUF jamba with {kind} layers {layers}, which no offset and "
                                  f"period place, is not supported")
    return offset, period

"""GGUF files of the state-space and hybrid architectures (mamba, mamba2, granitehybrid, lfm2,
jamba, falcon-h1, qwen3next, qwen35, qwen35moe, nemotron_h, nemotron_h_moe),
written here as llama.cpp's convert_hf_to_gguf.py writes them, run with the same greedy tokens
and logprobs as transformers on the weights the file holds."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from runtime.model_loader.gguf_loader import iterate_gguf_weights, load_gguf_config
from tests.model_loader.test_gguf_loader import add_tiny_tokenizer, finish, llama_cpp_permute
from tests.parity import assert_matches_hf, hf_greedy

VOCAB = 128
PROMPTS = [[VOCAB - 1, 5, 9, 12, 40], [VOCAB - 1] + list(range(20, 60))]
Q8_0, F16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
T = gguf.MODEL_TENSOR
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, initializer_range=0.2,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=0)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

CASES = {
    # Mamba 1: A [d_inner, N], dt projected from a low rank
    "mamba": (transformers.MambaForCausalLM, dict(state_size=16, expand=2, tie_word_embeddings=False)),
    # two groups of B and C (the gated norm per group), tied embeddings
    "mamba2": (transformers.Mamba2ForCausalLM, dict(
        expand=2, num_heads=8, head_dim=16, n_groups=2, state_size=16, tie_word_embeddings=True)),
    # Granite 4.0-H: Mamba 2, then attention without rope; top-2 of 4 experts and a shared MLP,
    # every multiplier away from 1
    "granitehybrid": (transformers.GraniteMoeHybridForCausalLM, dict(
        ATTENTION, layer_types=["mamba", "attention"], intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_expand=2, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
        tie_word_embeddings=False)),
    # a short gated conv (width 3), then attention with q/k norms; tied embeddings; the FFN
    # size as the converter writes it (already adjusted)
    "lfm2": (transformers.Lfm2ForCausalLM, dict(
        ATTENTION, intermediate_size=96, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention"],
        tie_word_embeddings=True)),
    # Jamba: Mamba 1 with dt/B/C norms, attention (no rope) in layers 1 and 3, top-2 of 4
    # experts in layers 0 and 2 (a Mamba and an attention layer each with experts and without)
    "jamba": (transformers.JambaForCausalLM, dict(
        ATTENTION, num_hidden_layers=4, intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=0,
        expert_layer_period=2, mamba_d_state=16, mamba_expand=2, tie_word_embeddings=False)),
}


def _metadata(writer: gguf.GGUFWriter, arch: str, model: torch.nn.Module) -> None:
    """The keys convert_hf_to_gguf.py's MambaModel, Mamba2Model, GraniteHybridModel, LFM2Model
    and JambaModel write."""
    c = model.config
    if arch in QWEN:
        return _qwen_metadata(writer, c)
    if arch in NEMOTRON_H:
        return _nemotron_h_metadata(writer, c)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_layer_norm_rms_eps(getattr(c, "layer_norm_epsilon", None) or
                                  getattr(c, "rms_norm_eps", None) or c.norm_eps)
    if arch in ("mamba", "mamba2"):
        writer.add_context_length(2**20)
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(c.conv_kernel)
        writer.add_ssm_inner_size(c.intermediate_size if arch == "mamba" else c.expand * c.hidden_size)
        writer.add_ssm_state_size(c.state_size)
        if arch == "mamba":
            writer.add_ssm_time_step_rank(c.time_step_rank)
            writer.add_ssm_dt_b_c_rms(False)
        else:
            writer.add_ssm_time_step_rank(c.num_heads)
            writer.add_ssm_group_count(c.n_groups)
        return
    types = c.layers_block_type if arch == "jamba" else c.layer_types
    kv = [c.num_key_value_heads if t in ("attention", "full_attention") else 0 for t in types]
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(kv)
    writer.add_vocab_size(VOCAB)
    if arch == "lfm2":
        writer.add_context_length(c.max_position_embeddings)
        writer.add_feed_forward_length(model.model.layers[0].feed_forward.w1.weight.shape[0])
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_shortconv_l_cache(c.conv_L_cache)
        return
    if arch == "jamba":
        writer.add_context_length(c.max_position_embeddings)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_ssm_conv_kernel(c.mamba_d_conv)
        writer.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
        writer.add_ssm_state_size(c.mamba_d_state)
        writer.add_ssm_time_step_rank(c.mamba_dt_rank)
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        return
    writer.add_context_length(2**20)  # no rope
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    writer.add_attention_scale(c.attention_multiplier)
    writer.add_embedding_scale(c.embedding_multiplier)
    writer.add_residual_scale(c.residual_multiplier)
    writer.add_logit_scale(c.logits_scaling)
    writer.add_ssm_conv_kernel(c.mamba_d_conv)
    writer.add_ssm_state_size(c.mamba_d_state)
    writer.add_ssm_group_count(c.mamba_n_groups)
    writer.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    writer.add_ssm_time_step_rank(c.mamba_n_heads)
    writer.add_rope_scaling_finetuned(False)


def _model_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _converted(arch: str, model: torch.nn.Module, name: str, data: torch.Tensor,
               fuse_gate_up: bool) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) as convert_hf_to_gguf.py makes them from one transformers tensor."""
    c = model.config
    if arch in QWEN:
        return _qwen_converted(c, arch, name, data, fuse_gate_up)
    if arch in NEMOTRON_H:
        return _nemotron_h_converted(c, arch, name, data)
    names = gguf.get_tensor_name_map(_model_arch(arch), c.num_hidden_layers)
    module, suffix = name.rsplit(".", 1)
    layer = int(name.split(".")[2]) if ".layers." in name else None

    def blk(tensor: T) -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=layer) + ".weight"

    mamba2 = arch in ("mamba2", "granitehybrid")
    if suffix in ("A_log", "D"):
        data = -torch.exp(data) if suffix == "A_log" else data
        return [(names.get_name(name), data.reshape(*data.shape, 1) if mamba2 and data.ndim == 1 else data)]
    if suffix == "dt_bias":
        return [(f"{names.get_name(module + '.dt_proj')}.bias", data)]
    if module.endswith(("conv1d", "conv.conv")) and suffix == "weight":
        return [(f"{names.get_name(module)}.weight", data.squeeze(1))]
    if module.endswith("mamba.norm") or (arch == "mamba2" and module.endswith("mixer.norm")):
        groups = c.mamba_n_groups if arch == "granitehybrid" else c.n_groups
        return [(f"{names.get_name(module)}.weight", data.reshape(groups, -1))]
    if suffix == "gate_up_proj":  # transformers fuses the experts' gate and up: [E, 2I, H]
        gate, up = data.chunk(2, dim=1)
        return [(blk(T.FFN_GATE_EXP), gate), (blk(T.FFN_UP_EXP), up)]
    if name.endswith("experts.down_proj"):
        return [(blk(T.FFN_DOWN_EXP), data)]
    if module.endswith("block_sparse_moe.router"):
        return [(blk(T.FFN_GATE_INP), data)]
    if module.endswith("shared_mlp.input_linear"):
        gate, up = data.chunk(2, dim=0)
        return [(blk(T.FFN_GATE_SHEXP), gate), (blk(T.FFN_UP_SHEXP), up)]
    if module.endswith("shared_mlp.output_linear"):
        return [(blk(T.FFN_DOWN_SHEXP), data)]
    if arch == "granitehybrid" and module.endswith("q_proj"):  # GraniteHybridModel.undo_permute
        data = torch.from_numpy(llama_cpp_permute(data.numpy(), c.num_attention_heads, c.num_attention_heads))
    elif arch == "granitehybrid" and module.endswith("k_proj"):
        data = torch.from_numpy(llama_cpp_permute(data.numpy(), c.num_attention_heads, c.num_key_value_heads))
    return [(f"{names.get_name(module)}.{suffix}", data)]


def assert_file_serves_as_hf(path: str, model: torch.nn.Module, architecture: str,
                             **engine) -> None:
    """The engine loads the GGUF file `path` as `architecture` and gives `model`'s (the
    transformers model on the file's weights) greedy tokens and logprobs for PROMPTS."""
    references = [hf_greedy(model, p, 8) for p in PROMPTS]
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", max_num_seqs=4, **engine)
    assert llm.engine.model_config.architecture == architecture
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(PROMPTS, params), references)


def write_hybrid_gguf(path: str, arch: str, model: torch.nn.Module,
                      qtype: gguf.GGMLQuantizationType, fuse_gate_up: bool = False,
                      mtp_block: bool = False) -> None:
    """Write `model` as llama.cpp's converter does (with `--fuse-gate-up-exps` if
    `fuse_gate_up`; with `mtp_block`, one multi-token prediction block after the decoder's, as
    Qwen3.5's converter writes it, its weights random: the reader must leave it out): matrices in `qtype` (F16 where a row is no whole number of Q8_0 blocks),
    vectors, convs and A in F32. The model's weights are then replaced by what the file holds
    (the converter moves whole rows only, or whole Q8_0 blocks of columns, so rounding each
    transformers row is rounding the file's), to be the reference for the file."""
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, arch, model)
    add_tiny_tokenizer(writer, VOCAB)
    writer.add_pad_token_id(0)
    if mtp_block:
        _add_mtp_block(writer, model.config)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        stored = None if tensor.ndim < 2 or "conv" in name or "A_log" in name else \
            qtype if qtype == Q8_0 and tensor.shape[-1] % 32 == 0 else F16
        for gguf_name, data in _converted(arch, model, name, tensor, fuse_gate_up):
            array = data.contiguous().numpy()
            if stored == Q8_0:
                writer.add_tensor(gguf_name, gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
            else:
                writer.add_tensor(gguf_name, array.astype(np.float16) if stored == F16 else array)
        if stored == Q8_0:
            tensor.copy_(torch.from_numpy(gguf.quants.dequantize(
                gguf.quants.quantize(tensor.numpy(), Q8_0), Q8_0)))
        elif stored == F16:
            tensor.copy_(tensor.half().float())
    finish(writer)


@pytest.mark.parametrize("arch,qtype", [("mamba", F16), ("mamba2", Q8_0), ("granitehybrid", F16),
                                        ("granitehybrid", Q8_0), ("lfm2", Q8_0), ("jamba", F16),
                                        ("jamba", Q8_0)])
def test_hybrid_gguf_matches_transformers(arch, qtype, tmp_path):
    cls, overrides = CASES[arch]
    config = cls.config_class(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = cls(config).eval()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    with torch.no_grad():
        write_hybrid_gguf(path, arch, model, qtype)
    read = load_gguf_config(path)
    assert read.architectures == [cls.__name__]
    for key in (*TINY, *overrides):
        # without rope, the converter writes a context of 2**20 rather than the config's
        if key not in ("initializer_range", "max_position_embeddings"):
            expected = getattr(config, key)  # floats come back as the file's float32
            assert getattr(read, key) == (pytest.approx(expected) if isinstance(expected, float)
                                          else expected), key
    # no max_model_len: the files of Mamba and Granite 4.0-H claim a context of 2**20, which
    # the engine lowers to what the KV cache holds
    assert_file_serves_as_hf(path, model, cls.__name__)


def test_hybrid_gguf_refuses_raw_blocks(tmp_path):
    cls, overrides = CASES["mamba2"]
    model = cls(cls.config_class(**TINY, **overrides)).eval()
    path = str(tmp_path / "tiny-mamba2.gguf")
    with torch.no_grad():
        write_hybrid_gguf(path, "mamba2", model, Q8_0)
    with pytest.raises(ValueError, match="--quantization gguf .* does not run GGUF mamba2"):
        next(iterate_gguf_weights(path, load_gguf_config(path), torch.float32, raw_linear=True))


# Falcon-H1 (its own converter, FalconH1Model): every muP multiplier away from 1 and folded into
# the weights; d_ssm (96) apart from expand * hidden; the gated norm, gate first as llama.cpp
FALCON_H1 = dict(
    ATTENTION, head_dim=16, intermediate_size=96, mamba_d_ssm=96, mamba_n_heads=8,
    mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16, mamba_rms_norm=True,
    mamba_norm_before_gate=False, embedding_multiplier=2.0, lm_head_multiplier=0.5,
    mlp_multipliers=[0.7, 1.3], key_multiplier=0.6, attention_in_multiplier=1.2,
    attention_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
    ssm_in_multiplier=1.1, ssm_out_multiplier=0.9, tie_word_embeddings=False)


def _falcon_h1_fold(c: transformers.FalconH1Config, name: str) -> torch.Tensor | float:
    """What FalconH1Model.modify_tensors multiplies parameter `name` by (in_proj: per row)."""
    scales = {"down_proj": c.mlp_multipliers[1], "gate_proj": c.mlp_multipliers[0],
              "k_proj": c.key_multiplier * c.attention_in_multiplier,
              "q_proj": c.attention_in_multiplier, "v_proj": c.attention_in_multiplier,
              "o_proj": c.attention_out_multiplier, "out_proj": c.ssm_out_multiplier,
              "lm_head": c.lm_head_multiplier, "embed_tokens": c.embedding_multiplier}
    if "in_proj" in name:
        bc = c.mamba_n_groups * c.mamba_d_state
        sizes = [c.mamba_d_ssm, c.mamba_d_ssm, bc, bc, c.mamba_n_heads]
        rows = torch.cat([torch.full((n, 1), m) for n, m in zip(sizes, c.ssm_multipliers)])
        return rows * c.ssm_in_multiplier
    return next((m for key, m in scales.items() if key in name), 1.0)


def _falcon_h1_metadata(writer: gguf.GGUFWriter, c: transformers.FalconH1Config) -> None:
    """The keys FalconH1Model (over Mamba2Model) writes."""
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_ssm_conv_kernel(c.mamba_d_conv)
    writer.add_ssm_inner_size(c.mamba_d_ssm)
    writer.add_ssm_state_size(c.mamba_d_state)
    writer.add_ssm_time_step_rank(c.mamba_d_ssm // c.mamba_d_head)
    writer.add_ssm_group_count(c.mamba_n_groups)
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])


def write_falcon_h1_gguf(path: str, model: torch.nn.Module, qtype: gguf.GGMLQuantizationType
                         ) -> None:
    """Write Falcon-H1 as the converter does (multipliers folded in, then rounded to `qtype`);
    the model's weights become the file's divided by what was folded in, so that transformers
    with its multipliers runs what the file holds."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, c.num_hidden_layers)
    writer = gguf.GGUFWriter(path, "falcon-h1")
    _falcon_h1_metadata(writer, c)
    add_tiny_tokenizer(writer, VOCAB)
    writer.add_pad_token_id(0)
    for name, tensor in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        fold = _falcon_h1_fold(c, name)
        data = tensor * fold
        if suffix == "dt_bias":  # Mamba2Model.filter_tensors: named as dt_proj's bias
            gguf_name = f"{names.get_name(module + '.dt_proj')}.bias"
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if suffix == "A_log":
            data = -torch.exp(data)
        if suffix in ("A_log", "D"):
            data = data.reshape(-1, 1)
        elif module.endswith("conv1d") and suffix == "weight":
            data = data.squeeze(1)
        elif module.endswith("mamba.norm"):
            data = data.reshape(c.mamba_n_groups, -1)
        array = data.contiguous().numpy()
        if tensor.ndim < 2 or "conv" in name:
            writer.add_tensor(gguf_name, array)
            continue
        if qtype == Q8_0 and array.shape[-1] % 32 == 0:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
            held = gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0)
        else:
            writer.add_tensor(gguf_name, array.astype(np.float16))
            held = array.astype(np.float16).astype(np.float32)
        tensor.copy_(torch.from_numpy(held) / fold)
    finish(writer)


@pytest.mark.parametrize("qtype", [F16, Q8_0])
def test_falcon_h1_gguf_matches_transformers(qtype, tmp_path):
    config = transformers.FalconH1Config(**{**TINY, **FALCON_H1})
    torch.manual_seed(0)
    model = transformers.FalconH1ForCausalLM(config).eval()
    path = str(tmp_path / "tiny-falcon-h1.gguf")
    with torch.no_grad():
        write_falcon_h1_gguf(path, model, qtype)
    read = load_gguf_config(path)
    assert read.architectures == ["FalconH1ForCausalLM"]
    for key in (*TINY, *FALCON_H1):
        if key in ("initializer_range", "mamba_chunk_size"):  # neither is in the file
            continue
        if "multiplier" in key:  # folded into the weights
            expected = [1.0] * len(config.ssm_multipliers if key.startswith("ssm_multipliers")
                                   else config.mlp_multipliers) \
                if key.endswith("multipliers") else 1.0
        else:
            expected = getattr(config, key)
        assert getattr(read, key) == (pytest.approx(expected) if isinstance(expected, float)
                                      else expected), key
    assert_file_serves_as_hf(path, model, "FalconH1ForCausalLM")


# Qwen3-Next and Qwen3.5: delta-nets in layers 0-2 (two value heads per key head, a Q8_0
# block of out_proj's columns per value head, as the converter's reordering of them moves whole
# blocks), gated attention in layer 3 (partial rope); Qwen3-Next's and Qwen3.5-MoE's layers with
# top-2 of 4 experts and a gated shared expert (llama.cpp names no dense FFN of qwen3next)
QWEN_TINY = dict(
    TINY, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256, intermediate_size=64, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, tie_word_embeddings=False)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32)
QWEN = {
    "qwen3next": (transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig,
                  dict(QWEN_TINY, **QWEN_MOE)),
    "qwen35": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig, QWEN_TINY),
    "qwen35moe": (transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig,
                  dict({k: v for k, v in QWEN_TINY.items() if k != "intermediate_size"},
                       **QWEN_MOE)),
}


def _qwen_metadata(writer: gguf.GGUFWriter, c) -> None:
    """The keys convert_hf_to_gguf.py's Qwen3NextModel (over Qwen2MoeModel) writes, and its
    Qwen3_5 models over it."""
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    if getattr(c, "intermediate_size", None):
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "num_experts", None):
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    writer.add_vocab_size(VOCAB)


def _add_mtp_block(writer: gguf.GGUFWriter, c) -> None:
    """Block `num_hidden_layers` as llama.cpp's qwen35 loader takes an MTP block: a gated
    attention layer (here with a dense FFN) and the nextn tensors, counted in block_count."""
    writer.add_block_count(c.num_hidden_layers + 1)  # overwrites the decoder's count
    writer.add_nextn_predict_layers(1)
    h, bid = c.hidden_size, c.num_hidden_layers
    shapes = {"attn_norm": (h,), "post_attention_norm": (h,), "attn_q": (2 * h, h),
              "attn_k": (h // 2, h), "attn_v": (h // 2, h), "attn_output": (h, h),
              "ffn_gate": (h, h), "ffn_up": (h, h), "ffn_down": (h, h),
              "nextn.eh_proj": (h, 2 * h), "nextn.enorm": (h,), "nextn.hnorm": (h,)}
    for name, shape in shapes.items():
        writer.add_tensor(f"blk.{bid}.{name}.weight", np.random.rand(*shape).astype(np.float32))


def _tile(c, data: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head
    [K, r, width] -> tiled [r, K, width] along `dim`."""
    k = c.linear_num_key_heads
    moved = data.movedim(dim, 0)
    grouped = moved.reshape(k, -1, width, *moved.shape[1:])
    return grouped.transpose(0, 1).reshape(moved.shape).movedim(0, dim)


def _qwen_tiled(c, name: str, data: torch.Tensor) -> torch.Tensor:
    """What _LinearAttentionVReorderBase does to a Qwen3.5 tensor before Qwen3NextModel's
    steps."""
    if ".linear_attn." not in name:
        return data
    dv, qk = c.linear_value_head_dim, 2 * c.linear_num_key_heads * c.linear_key_head_dim
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        data = data.squeeze(1) if data.ndim == 3 else data
        return torch.cat([data[:qk], _tile(c, data[qk:], 0, dv)])
    if name.endswith("in_proj_z.weight"):
        return _tile(c, data, 0, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return _tile(c, data, 0, 1)
    if name.endswith("out_proj.weight"):
        return _tile(c, data, 1, dv)
    return data


def _qwen_converted(c, arch: str, name: str, data: torch.Tensor, fuse_gate_up: bool
                    ) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) as Qwen3NextModel.modify_tensors (over Qwen2MoeModel's, which
    stacks the experts, and ModelBase's, which fuses gate and up) makes them; for Qwen3.5
    after its value heads are tiled."""
    if arch != "qwen3next":
        data = _qwen_tiled(c, name, data)
    if name.endswith(".A_log"):
        data = -torch.exp(data)
    elif name.endswith("conv1d.weight"):
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1
    layer = name.split(".")[2] if ".layers." in name else None
    if name.endswith("in_proj_qkvz.weight"):  # [q, k, v, z] per key head -> all q, k, v; all z
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        r = c.linear_num_value_heads // c.linear_num_key_heads
        q, k, v, z = data.view(c.linear_num_key_heads, -1, c.hidden_size).split(
            [dk, dk, r * dv, r * dv], 1)
        qkv = torch.cat([t.reshape(-1, c.hidden_size) for t in (q, k, v)])
        return [(f"blk.{layer}.attn_qkv.weight", qkv),
                (f"blk.{layer}.attn_gate.weight", z.reshape(-1, c.hidden_size))]
    if name.endswith("linear_attn.dt_bias"):
        return [(f"blk.{layer}.ssm_dt.bias", data)]
    if name.endswith("linear_attn.A_log"):
        return [(f"blk.{layer}.ssm_a", data)]
    if name.endswith("experts.gate_up_proj"):  # transformers' fused [E, 2I, H]
        if fuse_gate_up:  # split, then concatenated again along dim 1
            return [(f"blk.{layer}.ffn_gate_up_exps.weight", data)]
        gate, up = data.chunk(2, dim=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate),
                (f"blk.{layer}.ffn_up_exps.weight", up)]
    if name.endswith("experts.down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", data)]
    names = gguf.get_tensor_name_map(_model_arch(arch), c.num_hidden_layers)
    module, suffix = name.rsplit(".", 1)
    return [(f"{names.get_name(module)}.{suffix}", data)]


@pytest.mark.parametrize("arch,qtype,fuse_gate_up,mtp_block", [
    ("qwen3next", F16, False, False), ("qwen3next", Q8_0, True, False),
    ("qwen35", F16, False, True), ("qwen35", Q8_0, False, False),
    ("qwen35moe", F16, True, False), ("qwen35moe", Q8_0, False, False)])
def test_qwen_gguf_matches_transformers(arch, qtype, fuse_gate_up, mtp_block, tmp_path):
    cls, config_cls, overrides = QWEN[arch]
    config = config_cls(**overrides)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred norms start at 0: make them count
                tensor.normal_(0, 0.3)
        path = str(tmp_path / f"tiny-{arch}.gguf")
        write_hybrid_gguf(path, arch, model, qtype, fuse_gate_up, mtp_block)
    read = load_gguf_config(path)
    assert read.architectures == [cls.__name__]
    for key in overrides:
        if key != "initializer_range":
            assert getattr(read, key) == getattr(config, key), key
    assert read.layer_types == config.layer_types
    assert read.rope_parameters["partial_rotary_factor"] == pytest.approx(0.25)
    assert_file_serves_as_hf(path, model, cls.__name__, max_model_len=256)


# Nemotron-H: Mamba 2 (two groups), attention without rope, a squared-ReLU MLP; with experts
# (nemotron_h_moe), squared-ReLU experts (top-2 of 8 in 2 groups, one group kept, scaled, a
# shared expert, in a latent space as Nemotron 3 Super's) instead of the MLP
NEMOTRON_H_TINY = dict(
    TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
    tie_word_embeddings=False)
NEMOTRON_H = {
    "nemotron_h": dict(NEMOTRON_H_TINY, layer_types=["linear_attention", "full_attention",
                                                     "mlp"]),
    "nemotron_h_moe": dict(NEMOTRON_H_TINY, layer_types=["linear_attention", "moe",
                                                         "full_attention"],
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
                           routed_scaling_factor=1.5, moe_latent_size=32),
}


def _nemotron_h_metadata(writer: gguf.GGUFWriter, c) -> None:
    """The keys NemotronHModel (over GraniteHybridModel) writes."""
    layers = c.num_hidden_layers
    writer.add_block_count(layers)
    writer.add_context_length(2**20)  # no rope
    writer.add_embedding_length(c.hidden_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0
                              for t in c.layer_types])
    writer.add_layer_norm_eps(c.layer_norm_epsilon)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_vocab_size(VOCAB)
    writer.add_ssm_conv_kernel(c.conv_kernel)
    writer.add_ssm_state_size(c.ssm_state_size)
    writer.add_ssm_group_count(c.n_groups)
    writer.add_ssm_inner_size(c.mamba_num_heads * c.mamba_head_dim)
    writer.add_ssm_time_step_rank(c.mamba_num_heads)
    writer.add_rope_scaling_finetuned(False)
    if "moe" not in c.layer_types:
        writer.add_feed_forward_length([c.intermediate_size if t == "mlp" else 0
                                        for t in c.layer_types])
        return
    writer.add_feed_forward_length([c.moe_intermediate_size if t == "moe" else 0
                                    for t in c.layer_types])
    writer.add_expert_count(c.n_routed_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
    writer.add_expert_shared_count(c.n_shared_experts)
    writer.add_expert_weights_norm(c.norm_topk_prob)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    writer.add_expert_group_count(c.n_group)
    writer.add_expert_group_used_count(c.topk_group)
    if c.moe_latent_size is not None:
        writer.add_moe_latent_size(c.moe_latent_size)


def _nemotron_h_converted(c, arch: str, name: str, data: torch.Tensor
                          ) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) as NemotronHModel.modify_tensors (Mamba2Model's steps for the
    mixer, LlamaModel's q/k permutation for attention) makes them from a checkpoint tensor
    (`backbone.`, as saved)."""
    if name.startswith("model."):
        name = "backbone." + name.removeprefix("model.")
    names = gguf.get_tensor_name_map(_model_arch(arch), c.num_hidden_layers)
    module, suffix = name.rsplit(".", 1)
    layer = name.split(".")[2] if ".layers." in name else None
    if suffix in ("up_proj", "down_proj"):  # stacked experts [E, out, in]
        return [(f"blk.{layer}.ffn_{suffix[:-5]}_exps.weight", data)]
    if suffix == "e_score_correction_bias":
        return [(f"blk.{layer}.exp_probs_b.bias", data)]
    if suffix in ("A_log", "D"):
        data = -torch.exp(data) if suffix == "A_log" else data
        return [(names.get_name(name), data.reshape(-1, 1))]
    if suffix == "dt_bias":
        return [(f"{names.get_name(module + '.dt')}.bias", data)]
    if module.endswith("conv1d") and suffix == "weight":
        data = data.squeeze(1)
    elif module.endswith("mixer.norm"):
        data = data.reshape(c.n_groups, -1)
    elif module.endswith("q_proj"):
        data = torch.from_numpy(llama_cpp_permute(data.numpy(), c.num_attention_heads,
                                                  c.num_attention_heads))
    elif module.endswith("k_proj"):
        data = torch.from_numpy(llama_cpp_permute(data.numpy(), c.num_attention_heads,
                                                  c.num_key_value_heads))
    return [(f"{names.get_name(module)}.{suffix}", data)]


@pytest.mark.parametrize("arch,qtype", [("nemotron_h", F16), ("nemotron_h", Q8_0),
                                        ("nemotron_h_moe", Q8_0)])
def test_nemotron_h_gguf_matches_transformers(arch, qtype, tmp_path):
    overrides = NEMOTRON_H[arch]
    config = transformers.NemotronHConfig(**overrides)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).eval()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    with torch.no_grad():
        write_hybrid_gguf(path, arch, model, qtype)
    read = load_gguf_config(path)
    assert read.architectures == ["NemotronHForCausalLM"]
    for key in overrides:
        if key not in ("initializer_range", "max_position_embeddings"):
            expected = getattr(config, key)
            assert getattr(read, key) == (pytest.approx(expected) if isinstance(expected, float)
                                          else expected), key
    assert_file_serves_as_hf(path, model, "NemotronHForCausalLM")

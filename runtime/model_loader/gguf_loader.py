"""Read GGUF checkpoints (llama.cpp's format) as Hugging Face configs, tokenizers and weights.

Weights come out under the parameter names and in the layouts of the transformers model,
dequantized: GGUF stores dimensions innermost-first, renames every tensor, stacks the experts
of a MoE layer into one tensor per projection, and for the llama architecture stores q/k rows
in the interleaved order of llama.cpp's rotary; each of those is undone here. The state-space
and hybrid architectures (runtime/model_loader/gguf_hybrid.py) bring their own configs, names
and transforms.

Only a file's first load parses it: the completed config, the tokenizer and an index of
where each tensor lies are cached (runtime/model_loader/gguf_cache.py), and weights are
read from the memory-mapped file at the indexed offsets.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from runtime.layers.rotary import compute_inv_freq, rope_parameters
from runtime.model_loader.gguf_cache import cached_part
from runtime.model_loader.gguf_header import gguf_architecture
from runtime.model_loader.gguf_hybrid import HYBRID_ARCHITECTURES, hybrid_config, hybrid_tensor
from runtime.model_loader.gguf_qwen3next import FUSED_EXPERTS, untile_value_heads
from runtime.progress import progress_bar

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe",
                           "qwen3moe", *HYBRID_ARCHITECTURES)
# GGUF files carry no `architectures` list; the engine's model registry needs one.
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                     "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                     "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                     **HYBRID_ARCHITECTURES}
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight alone).
_NORM_PLUS_ONE = ("gemma2", "gemma3")

# MoE architectures -> norm_topk_prob: llama.cpp's graphs renormalise the top-k router weights
# of qwen3moe and never those of qwen2moe, whatever the original config said (the file does not
# say).
_MOE_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}
# Stacked expert tensors ([experts, out, in]) come out one expert at a time, as
# `...experts.{j}.gate_proj.weight`, the per-expert names of Hugging Face checkpoints.
_EXPERTS = ".mlp.experts."

# Tensors that hold settings rather than parameters (read into the config).
_SETTINGS_TENSORS = ("rope_freqs.weight",)

# What llama.cpp's converter assumes for Llama 3.x when it bakes "llama3" rope into rope_freqs.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Next to config.json in the cached "model" part: where each weight lies in the file.
_TENSOR_INDEX = "tensors.json"
# Elements dequantized at once: large enough to amortize numpy's overhead, small enough for the cache.
_DEQUANTIZE_CHUNK = 1 << 18


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config of a GGUF file, completed where transformers falls short.

    transformers reads neither `{arch}.rope.scaling.*` nor the `rope_freqs` tensor in which
    llama.cpp stores Llama 3's "llama3" rope (both become the config's rope parameters
    here), nor sets a llama model's `attention_bias` from its tensors. An unsupported
    architecture is refused from the header alone, before anything is parsed or cached.
    """
    _check_architecture(gguf_architecture(path))
    return AutoConfig.from_pretrained(cached_part(path, "model", _build_model))


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template, when the file has one) stored in a GGUF file."""
    return AutoTokenizer.from_pretrained(cached_part(path, "tokenizer", _build_tokenizer))


# Weights of linear layers, which `raw_linear=True` yields still quantized.
_LINEAR_WEIGHTS = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
                   ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def iterate_gguf_weights(
    path: str, hf_config: PretrainedConfig, dtype: torch.dtype, raw_linear: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (transformers parameter name, dequantized tensor in `dtype`) for every weight.

    With `raw_linear`, the quantized weights of linear layers come as
    `runtime.quantization.gguf.GGUFWeight` (the file's blocks, one row per output feature) instead.

    A model with tied embeddings has no `output.weight`, so nothing comes for `lm_head.weight`.
    The tensors are read from the memory-mapped file at the offsets the cached index gives.
    """
    with open(os.path.join(cached_part(path, "model", _build_model), _TENSOR_INDEX)) as f:
        index = json.load(f)
    if raw_linear and index["architecture"] in HYBRID_ARCHITECTURES:
        raise ValueError(f"--quantization gguf (the file's blocks kept) does not run GGUF "
                         f"{index['architecture']} yet; load the file without it (dequantized)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    parts: dict[str, list] = {}  # the pieces of tensors the converter split, until all came
    for entry in progress_bar(index["tensors"], "Loading GGUF weights", unit="tensor"):
        stored = np.dtype(entry["dtype"])
        start = entry["offset"]
        raw = data[start:start + stored.itemsize * math.prod(entry["data_shape"])]
        raw = raw.view(stored).reshape(entry["data_shape"])
        # the fused gate/up experts go whole, as transformers 5 stacks them: the MoE loader
        # takes them so
        if _EXPERTS in entry["name"] and not entry["name"].endswith(FUSED_EXPERTS):
            yield from _split_experts(entry["name"], _dequantize(raw, gguf.GGMLQuantizationType(
                entry["type"])).reshape(entry["shape"]), dtype)
            continue
        if raw_linear and entry["name"].endswith(_LINEAR_WEIGHTS) and \
                getattr(gguf.quants, gguf.GGMLQuantizationType(entry["type"]).name, None):
            yield entry["name"], _raw_weight(raw, entry, index["architecture"], hf_config)
            continue
        weight = _dequantize(raw, gguf.GGMLQuantizationType(entry["type"])).reshape(entry["shape"])
        if index["architecture"] == "llama" and ".attn_q." in entry["gguf_name"]:
            weight = _unpermute(weight, hf_config.num_attention_heads)
        elif index["architecture"] == "llama" and ".attn_k." in entry["gguf_name"]:
            weight = _unpermute(weight, hf_config.num_key_value_heads)
        elif index["architecture"] in _NORM_PLUS_ONE and entry["name"].endswith("norm.weight"):
            weight = weight - 1
        elif entry.get("transform"):
            weight = _undo_transform(weight, entry["transform"], hf_config)
        if entry.get("merge"):
            part, count, dim = entry["merge"]
            pieces = parts.setdefault(entry["name"], [None] * count)
            pieces[part] = weight
            if any(piece is None for piece in pieces):
                continue
            weight = np.concatenate(parts.pop(entry["name"]), axis=dim)
        # The file is memory-mapped read-only; torch wants memory it may write.
        yield entry["name"], torch.from_numpy(np.require(weight, requirements=["C", "W"])).to(dtype)


def _undo_transform(weight: np.ndarray, transform: str, hf_config: PretrainedConfig) -> np.ndarray:
    """Invert what convert_hf_to_gguf.py did to a hybrid's tensor (gguf_tensor.HybridTensor);
    steps joined by "+" are undone in turn."""
    if "+" in transform:
        for step in transform.split("+"):
            weight = _undo_transform(weight, step, hf_config)
        return weight
    if transform.startswith("v_heads_"):  # Qwen3.5's value heads, tiled
        return untile_value_heads(weight, transform[len("v_heads_"):], hf_config)
    if transform == "a_log":  # the converter stores A = -exp(A_log)
        return np.log(-weight)
    if transform == "minus_one":  # a zero-centred RMSNorm's weight, stored as 1 + w
        return weight - 1
    if transform == "permute_q":
        return _unpermute(weight, hf_config.num_attention_heads)
    if transform == "permute_k":
        return _unpermute(weight, hf_config.num_key_value_heads)
    raise ValueError(f"unknown GGUF tensor transform {transform!r}")


def _split_experts(name: str, stacked: np.ndarray, dtype: torch.dtype
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`...experts.gate_proj.weight` [E, out, in] -> E tensors `...experts.{j}.gate_proj.weight`."""
    head, _, tail = name.partition(_EXPERTS)
    experts = torch.from_numpy(np.require(stacked, requirements=["C", "W"])).to(dtype)
    for j, weight in enumerate(experts):
        yield f"{head}{_EXPERTS}{j}.{tail}", weight


def _raw_weight(raw: np.ndarray, entry: dict, arch: str, hf_config: PretrainedConfig):
    """The file's blocks as [rows, bytes per row], q/k rows put back in transformers' order."""
    from runtime.quantization.gguf import GGUFWeight
    rows = np.array(raw, dtype=np.uint8).reshape(entry["shape"][0], -1)
    if arch == "llama" and ".attn_q." in entry["gguf_name"]:
        rows = _unpermute(rows, hf_config.num_attention_heads)
    elif arch == "llama" and ".attn_k." in entry["gguf_name"]:
        rows = _unpermute(rows, hf_config.num_key_value_heads)
    return GGUFWeight(entry["type"], torch.from_numpy(np.ascontiguousarray(rows)),
                      tuple(entry["shape"]))


def _build_model(path: str, folder: str) -> None:
    """Write the completed config (config.json) and the tensor index of GGUF file `path` to `folder`.

    The index gives, for each weight, its transformers and GGUF names, its ggml type, and
    where and how its bytes lie in the file, as `gguf.GGUFReader` reads them.
    """
    reader = gguf.GGUFReader(path)
    arch = _architecture(reader)
    if arch in HYBRID_ARCHITECTURES:
        _build_hybrid_model(reader, arch, folder)
        return
    directory, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if not getattr(config, "architectures", None):
        config.architectures = [HF_ARCHITECTURES[arch]]
    if arch == "llama":
        # transformers leaves attention_bias at False even when the file has the biases.
        config.attention_bias = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    if arch in _MOE_NORM_TOPK_PROB:
        _complete_moe_config(reader, arch, config)
    scaling = _rope_scaling(reader, config)
    if scaling:
        if getattr(config, "rope_parameters", None) is not None:  # transformers >= 5
            config.rope_parameters = {**config.rope_parameters, **scaling}
        else:
            config.rope_scaling = scaling
    config.save_pretrained(folder)

    hf_names = _hf_names(config, arch)
    tensors = []
    for tensor in reader.tensors:
        if tensor.name in _SETTINGS_TENSORS:
            continue
        if tensor.name not in hf_names:
            model = type(config).__name__
            raise ValueError(f"GGUF tensor {tensor.name!r} ({arch}) matches no parameter of {model}")
        shape = [int(d) for d in reversed(tensor.shape)]
        if tensor.name.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 1:
            shape = [1, *shape]  # older converters squeezed the [1, hidden] shared-expert gate
        tensors.append({
            "name": hf_names[tensor.name], "gguf_name": tensor.name, "type": int(tensor.tensor_type),
            "offset": int(tensor.data_offset), "dtype": tensor.data.dtype.str,
            "data_shape": list(tensor.data.shape), "shape": shape,
        })
    with open(os.path.join(folder, _TENSOR_INDEX), "w") as f:
        json.dump({"architecture": arch, "tensors": tensors}, f, indent=1)


def _build_hybrid_model(reader: gguf.GGUFReader, arch: str, folder: str) -> None:
    """`_build_model` for the state-space and hybrid architectures of gguf_hybrid.py."""
    config = hybrid_config(reader, arch)
    config.save_pretrained(folder)
    tensors = []
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= config.num_hidden_layers:
            continue  # a multi-token prediction block (Qwen3.5's), past the decoder's layers
        target = hybrid_tensor(tensor.name, arch)
        if target is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({arch}) matches no parameter of "
                             f"{HYBRID_ARCHITECTURES[arch]}")
        shape = [int(d) for d in reversed(tensor.shape)]
        if target.reshape == "conv":  # squeezed from [channels, 1, width]
            shape = [shape[0], 1, shape[-1]]
        elif target.reshape == "flat":
            shape = [math.prod(shape)]
        tensors.append({
            "name": target.name, "gguf_name": tensor.name, "type": int(tensor.tensor_type),
            "offset": int(tensor.data_offset), "dtype": tensor.data.dtype.str,
            "data_shape": list(tensor.data.shape), "shape": shape,
            "transform": target.transform, "merge": target.merge,
        })
    with open(os.path.join(folder, _TENSOR_INDEX), "w") as f:
        json.dump({"architecture": arch, "tensors": tensors}, f, indent=1)


def _complete_moe_config(reader: gguf.GGUFReader, arch: str, config: PretrainedConfig) -> None:
    """The expert sizes transformers' GGUF config leaves at their defaults, with llama.cpp's
    fallbacks when a key is absent (an expert of n_ff / n_expert_used, a shared expert of n_ff),
    and the router's renormalisation as llama.cpp runs it."""
    def field(key: str, default):
        value = reader.fields.get(key.format(arch=arch))
        return default if value is None else value.contents()

    config.moe_intermediate_size = field(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
                                         config.intermediate_size // config.num_experts_per_tok)
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = field(
            gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, config.intermediate_size)
    config.norm_topk_prob = _MOE_NORM_TOPK_PROB[arch]


def _build_tokenizer(path: str, folder: str) -> None:
    """Save the tokenizer of GGUF file `path` (files of `save_pretrained`) to `folder`."""
    directory, name = os.path.split(os.path.abspath(path))
    # AutoTokenizer would first read the config the way transformers does, which it cannot for
    # most hybrids; the tokenizer itself is read from the same keys either way.
    tokenizer_class = PreTrainedTokenizerFast if gguf_architecture(path) in HYBRID_ARCHITECTURES \
        else AutoTokenizer
    tokenizer_class.from_pretrained(directory, gguf_file=name).save_pretrained(folder)


def _dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.dequantize`, by chunks of rows: gguf goes 16 rows at a time, 3x slower.

    The same per-block functions of gguf run on the same values, so the result is bit-identical.
    """
    quant = getattr(gguf.quants, qtype.name, None)  # gguf's class for the type; none for F32/F16
    if quant is None:
        return gguf.quants.dequantize(raw, qtype)
    quant.init_grid()
    rows = raw.reshape(-1, raw.shape[-1])
    row_size = rows.shape[1] // quant.type_size * quant.block_size
    out = np.empty((rows.shape[0], row_size), dtype=np.float32)
    step = max(1, _DEQUANTIZE_CHUNK // row_size)
    for i in range(0, len(rows), step):
        out[i:i + step] = quant.dequantize_rows(rows[i:i + step])
    return out


def _architecture(reader: gguf.GGUFReader) -> str:
    return _check_architecture(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())


def _check_architecture(arch: str) -> str:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (other architectures run from a "
                         f"Hugging Face folder, natively or through the transformers fallback)")
    return arch


def _hf_names(hf_config: PretrainedConfig, arch: str) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, through gguf's own name table.

    That table maps the names of many checkpoint formats to one GGUF name, so the
    transformers names to look up come from the model itself, built without memory.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    model_arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    name_map = gguf.get_tensor_name_map(model_arch, hf_config.num_hidden_layers)
    names = {}
    for hf_name in model.state_dict():
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    if arch in _MOE_NORM_TOPK_PROB:  # the stacked experts, whatever transformers' own layout
        for layer in range(hf_config.num_hidden_layers):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                stacked = f"model.layers.{layer}{_EXPERTS}{proj}"
                names[f"{name_map.get_name(stacked)}.weight"] = f"{stacked}.weight"
    return names


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `LlamaModel.permute` of q/k rows (weights and biases).

    Per head, transformers keeps the two rotary halves apart ([x0..x(d/2-1), y0..]) and
    llama.cpp interleaves them ([x0, y0, x1, y1, ...]).
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _rope_scaling(reader: gguf.GGUFReader, config: PretrainedConfig) -> dict:
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()

    def field(key: str):
        value = reader.fields.get(key.format(arch=arch))
        return None if value is None else value.contents()

    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        factors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type)
        return _llama3_from_rope_freqs(factors, config)

    kind = field(gguf.Keys.Rope.SCALING_TYPE)
    factor = field(gguf.Keys.Rope.SCALING_FACTOR)
    if kind in (None, "none") or not factor:
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        optional = {
            "original_max_position_embeddings": gguf.Keys.Rope.SCALING_ORIG_CTX_LEN,
            "beta_fast": gguf.Keys.Rope.SCALING_YARN_BETA_FAST,
            "beta_slow": gguf.Keys.Rope.SCALING_YARN_BETA_SLOW,
        }
        scaling.update({k: v for k, key in optional.items() if (v := field(key)) is not None})
        return scaling
    raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported")


def _llama3_from_rope_freqs(rope_freqs: np.ndarray, config: PretrainedConfig) -> dict:
    """Recover "llama3" rope parameters from the per-frequency divisors llama.cpp stores.

    Only the factor varies between Llama 3.1/3.2/3.3 (8 or 32); the other settings are the
    converter's defaults, and the divisors they give are checked against the file.
    """
    scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), **_LLAMA3_DEFAULTS}
    params = {**rope_parameters(config), **scaling}
    dim = 2 * len(rope_freqs)
    plain, _ = compute_inv_freq({**params, "rope_type": "default"}, dim, 1)
    scaled, _ = compute_inv_freq(params, dim, 1)
    if not np.allclose((plain / scaled).numpy(), rope_freqs, rtol=1e-4):
        raise NotImplementedError(
            "the GGUF rope_freqs tensor matches no llama3 rope with llama.cpp's default parameters"
        )
    return scaling

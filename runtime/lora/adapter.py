"""Reading and checking a PEFT adapter folder against the base model it is meant for.

PEFT names each adapted module by its Hugging Face path (`...layers.0.self_attn.q_proj`); our
models fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so each PEFT module maps to
one slice of one of our layers. B is stored pre-multiplied by the adapter's scaling
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from runtime.lora.request import LoRARequest

# PEFT module name -> (our layer's name, slice index within its fused output)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
           "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_PREFIX = "base_model.model."


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], times the adapter's scaling


@dataclass
class LoRAAdapter:
    int_id: int
    name: str
    rank: int
    # (our layer's module path, slice index) -> that slice's weights
    weights: dict[tuple[str, int], LoRAWeights]


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of every module an adapter may target, by PEFT module path."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    per_layer = {"self_attn.q_proj": (heads * head_dim, hidden),
                 "self_attn.k_proj": (kv_heads * head_dim, hidden),
                 "self_attn.v_proj": (kv_heads * head_dim, hidden),
                 "self_attn.o_proj": (hidden, heads * head_dim),
                 "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                 "mlp.down_proj": (hidden, inter)}
    return {f"model.layers.{i}.{name}": shape
            for i in range(hf_config.num_hidden_layers) for name, shape in per_layer.items()}


def _read_config(request: LoRARequest) -> dict[str, Any]:
    path = request.lora_path
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: no folder at {path!r}")
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {path!r} has no "
                         "adapter_config.json (a PEFT adapter folder is expected)")
    with open(config_file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {request.lora_name!r}: peft_type must be LORA, got "
                         f"{config.get('peft_type')!r}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {key} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {request.lora_name!r}: bias must be 'none', got "
                         f"{config['bias']!r}")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets] if targets in TARGETS else []  # a regex: the weights tell
    lacking = sorted(set(targets) - set(TARGETS))
    if lacking:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: target modules {lacking} are not "
                         f"among this model's adaptable modules; allowed: {sorted(TARGETS)}")
    return config


def load_adapter(request: LoRARequest, hf_config: Any, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check the adapter `request` names; ValueError says what is wrong with it."""
    from safetensors.torch import load_file
    config = _read_config(request)
    rank = int(config["r"])
    name = request.lora_name
    if not 1 <= rank <= max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank "
                         f"{max_lora_rank} (raise --max-lora-rank)")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = os.path.join(request.lora_path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise ValueError(f"LoRA adapter {name!r}: {request.lora_path!r} has no "
                         "adapter_model.safetensors")
    tensors = load_file(weights_file)
    shapes = module_shapes(hf_config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {name!r}: unsupported tensor {key!r} (only "
                             "lora_A / lora_B weights of linear projections are)")
        if module not in shapes:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} is not in the model; "
                             f"allowed: {sorted(TARGETS)} of layers 0.."
                             f"{hf_config.num_hidden_layers - 1}")
        pairs.setdefault(module, {})[kind[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        out_size, in_size = shapes[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise ValueError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
        if a.shape != (rank, in_size) or b.shape != (out_size, rank):
            raise ValueError(f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}, this model needs A {(rank, in_size)} and B "
                             f"{(out_size, rank)}: is it for another base model?")
        parent, _, leaf = module.rpartition(".")
        layer, index = TARGETS[leaf]
        weights[(f"{parent}.{layer}", index)] = LoRAWeights(
            a.to(dtype), (b.float() * scaling).to(dtype))
    return LoRAAdapter(request.lora_int_id, name, rank, weights)

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
from typing import Any, Callable, Container

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


def check_files(request: LoRARequest) -> None:
    """Raise ValueError unless the adapter's folder still holds its two files (a cheap check
    for an adapter validated earlier, whose folder may have gone since)."""
    path, name = request.lora_path, request.lora_name
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: no folder at {path!r}")
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        if not os.path.isfile(os.path.join(path, file)):
            raise ValueError(f"LoRA adapter {name!r}: {path!r} has no {file} (a PEFT adapter "
                             "folder is expected)")


def _read_config(request: LoRARequest) -> dict[str, Any]:
    config_file = os.path.join(request.lora_path, "adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: cannot read {config_file}: "
                         f"{e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {config_file} is not a JSON "
                         "object")
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


def _read_tensors(request: LoRARequest, wanted: Callable[[str], bool],
                  ) -> dict[str, tuple[tuple[int, ...], torch.Tensor | None]]:
    """Every tensor's shape, and the tensor itself where `wanted(key)`; a file that cannot be
    read (gone, unreadable, corrupt) is a ValueError."""
    from safetensors import SafetensorError, safe_open
    weights_file = os.path.join(request.lora_path, "adapter_model.safetensors")
    try:
        with safe_open(weights_file, framework="pt") as f:
            return {key: (tuple(f.get_slice(key).get_shape()),
                          f.get_tensor(key) if wanted(key) else None) for key in f.keys()}
    except (OSError, SafetensorError) as e:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: cannot read {weights_file}: "
                         f"{e}") from None


def load_adapter(request: LoRARequest, hf_config: Any, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32,
                 layers: Container[str] | None = None) -> LoRAAdapter:
    """Read and check the adapter `request` names; ValueError says what is wrong with it.
    With `layers` (our layers' module paths, a pipeline stage's), only their weights are
    read; every module's shapes are checked."""
    check_files(request)
    config = _read_config(request)
    rank = int(config["r"])
    name = request.lora_name
    if not 1 <= rank <= max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank "
                         f"{max_lora_rank} (raise --max-lora-rank)")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    def our_layer(module: str) -> str:
        parent, _, leaf = module.rpartition(".")
        return f"{parent}.{TARGETS[leaf][0]}" if leaf in TARGETS else module

    def wanted(key: str) -> bool:
        module = key.removeprefix(_PREFIX).rpartition(".lora_")[0]
        return layers is None or our_layer(module) in layers

    shapes = module_shapes(hf_config)
    pairs: dict[str, dict[str, tuple[tuple[int, ...], torch.Tensor | None]]] = {}
    for key, entry in _read_tensors(request, wanted).items():
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {name!r}: unsupported tensor {key!r} (only "
                             "lora_A / lora_B weights of linear projections are)")
        if module not in shapes:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} is not in the model; "
                             f"allowed: {sorted(TARGETS)} of layers 0.."
                             f"{hf_config.num_hidden_layers - 1}")
        pairs.setdefault(module, {})[kind[0]] = entry
    weights = {}
    for module, pair in pairs.items():
        out_size, in_size = shapes[module]
        if "A" not in pair or "B" not in pair:
            raise ValueError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
        (a_shape, a), (b_shape, b) = pair["A"], pair["B"]
        if a_shape != (rank, in_size) or b_shape != (out_size, rank):
            raise ValueError(f"LoRA adapter {name!r}: {module} has A {a_shape} and B "
                             f"{b_shape}, this model needs A {(rank, in_size)} and B "
                             f"{(out_size, rank)}: is it for another base model?")
        if a is None or b is None:  # another pipeline stage's layer
            continue
        weights[(our_layer(module), TARGETS[module.rpartition(".")[2]][1])] = LoRAWeights(
            a.to(dtype), (b.float() * scaling).to(dtype))
    return LoRAAdapter(request.lora_int_id, name, rank, weights)

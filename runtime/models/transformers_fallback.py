"""Any transformers decoder on our KV cache: the model is transformers' own code, its attention
ours.

As vLLM's `TransformersForCausalLM`: the `AutoModelForCausalLM` class is built from the config
with `attn_implementation="runtime"`, an attention function registered in transformers'
`AttentionInterface`. Every attention module of the model then hands its Q, K and V to that
function, which runs them through one of our `Attention` layers (the paged KV cache, the
platform's backend, the step's metadata from the forward context). Since the name is not one
transformers builds masks for, the model computes no mask: causality and sequence boundaries are
the backend's business. The flat batch runs as one sequence of `num_tokens` tokens with the
positions of each request's tokens as `position_ids`.

As vLLM's backend does, the model's `nn.Linear` layers then compute through the platform's dense
kernel (the `linear` custom op: oneDNN-packed weights on the CPU) and its RMSNorms whose forward
is Llama's, line for line, through the `rms_norm` op; both keep the original parameters, so
names, ties and the loader are unchanged.
"""
from __future__ import annotations

import functools
import inspect
from typing import Iterable

import torch
from torch import nn

from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.layernorm import RMSNorm
from runtime.models.llama import default_weight_loader, layer_sliding_window
from runtime.quantization.base import LinearMethod

ATTENTION_NAME = "runtime"


def transformers_class(architecture: str) -> type | None:
    """The transformers class of `architecture` when it can run on our attention, else None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if architecture not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return None
    cls = getattr(transformers, architecture, None)
    return cls if cls is not None and cls.is_backend_compatible() else None


def runtime_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              scaling: float | None = None,
                              attention_instances: nn.ModuleList | None = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, H, T, D], key/value [1, Hkv, T, D]
    -> ([1, T, H, D], no weights). Runs layer `module.layer_idx` of `attention_instances`
    (whose sliding window and soft-cap come from the config, as the model's own do)."""
    attn = attention_instances[module.layer_idx]
    t = query.size(2)
    # The module's own scaling is the backend's (as vLLM's): a model that pre-scales its
    # query passes 1.0 (OPT). It is the same at every call of a layer.
    attn.impl.scale = query.size(-1) ** -0.5 if scaling is None else scaling
    out = attn(*(x[0].transpose(0, 1).reshape(t, -1) for x in (query, key, value)))
    return out.view(1, t, attn.num_heads, attn.head_size), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, runtime_attention_forward)


class PlatformLinear(nn.Module):
    """An `nn.Linear`'s own weight and bias, computed by the platform's dense kernel, which
    takes [rows, in] inputs (the worker prepares it once the weights are loaded)."""

    def __init__(self, linear: nn.Linear, method: LinearMethod) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x.reshape(-1, self.in_features), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


@functools.cache
def _forward_source(cls: type) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def computes_as_llama_rms_norm(module: nn.Module) -> bool:
    """Whether `module`'s forward is Llama's RMSNorm, line for line (well over a hundred
    transformers classes copy it: Mistral, Qwen2, Granite …; Olmo 2's and Gemma's differ)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    source = _forward_source(type(module))
    return source is not None and source == _forward_source(LlamaRMSNorm)


def use_platform_layers(model: nn.Module, ctx: BuildContext) -> None:
    """Replace, in place, `nn.Linear` layers (not subclasses, whose forward may differ) and
    Llama-style RMSNorms with modules that hold the same parameters and run the platform's
    `linear` and `rms_norm` ops."""
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            new = PlatformLinear(module, ctx.linear_method(name))
        elif computes_as_llama_rms_norm(module):
            new = RMSNorm(module.weight.numel(), module.variance_epsilon, ctx)
            new.weight = module.weight
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)


class TransformersForCausalLM(nn.Module):
    """The engine's model contract (`forward`, `compute_logits`, `load_weights`) around a
    transformers causal LM."""

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if ctx.tp_size > 1 or ctx.pp.size > 1:
            raise ValueError("the transformers fallback runs on one rank only: tensor and "
                             "pipeline parallel need a native model class")
        if ctx.quant_config is not None:
            raise ValueError(f"the transformers fallback runs unquantized weights only, not "
                             f"{ctx.quant_config.name}")
        architecture = (getattr(config, "architectures", None) or ["?"])[0]
        cls = transformers_class(architecture)
        if cls is None:
            raise ValueError(f"transformers has no {architecture} that routes its attention "
                             "through AttentionInterface")
        _register_attention()
        from transformers.initialization import no_init_weights
        config._attn_implementation = ATTENTION_NAME
        with no_init_weights():  # the loader fills every weight
            self.hf = cls._from_config(config, dtype=ctx.dtype)
        self.hf.tie_weights()
        self.hf.eval()
        use_platform_layers(self.hf, ctx)
        self.config = config
        text = config.get_text_config()
        num_heads = text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        soft_cap = getattr(text, "attn_logit_softcapping", None)
        self.attention_instances = nn.ModuleList(
            Attention(num_heads, head_size, 1.0, num_kv_heads, ctx, layer_sliding_window(text, i),
                      soft_cap)
            for i in range(text.num_hidden_layers))
        self.final_logit_softcapping = getattr(text, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                 use_cache=False, attention_instances=self.attention_instances)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden).float()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors by their checkpoint names, renamed as transformers renames them
        (its conversion mapping's renamings, the base model's prefix added or stripped);
        returns our names of the parameters loaded, tied ones included. Conversions that fuse
        or split tensors (e.g. per-expert weights into one) are not done here: such a tensor
        has no place and is refused."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
        renamings = [t for t in get_model_conversion_mapping(self.hf)
                     if isinstance(t, WeightRenaming)]
        hf_params = dict(self.hf.named_parameters(remove_duplicate=False))
        buffers = {name for name, _ in self.hf.named_buffers()}
        loaded: set[str] = set()
        for name, tensor in weights:
            target, _ = rename_source_key(name, renamings, [], self.hf.base_model_prefix,
                                          hf_params)
            if target in hf_params:
                default_weight_loader(hf_params[target], tensor)
                loaded.add(f"hf.{target}")
            elif target not in buffers and not target.endswith(".inv_freq"):
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self.hf).__name__} (the transformers fallback)")
        return loaded | self._tied(loaded)

    def _tied(self, loaded: set[str]) -> set[str]:
        """Names that share storage with a loaded parameter (a tied LM head)."""
        by_storage: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            by_storage.setdefault(id(p), []).append(name)
        return {n for names in by_storage.values() if loaded & set(names) for n in names}

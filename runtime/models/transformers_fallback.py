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

What the fallback cannot run exactly is refused before anything is built
(`runtime.models.fallback_checks`): modules that keep state between steps, attention-function
arguments that our `Attention` does not honour, looped layers, shapes the KV cache cannot
hold, vision-language models. Logits come from the causal LM's own head code, run on
our hidden states, so its scaling and soft-capping are transformers' own.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.layernorm import RMSNorm
from runtime.models.fallback_checks import (attention_modules, base_model_name, fallback_refusal,
                                            forward_source)
from runtime.models.llama import default_weight_loader, layer_sliding_window
from runtime.quantization.base import LinearMethod


ATTENTION_NAME = "runtime"


def transformers_class(architecture: str) -> type | None:
    """The transformers causal-LM class named `architecture` whose attention goes through
    AttentionInterface, else None. Whether it runs exactly is `fallback_refusal`'s question."""
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
    (whose sliding window and soft-cap come from the module, as the model's own do); anything
    passed that it would not honour is an error, never dropped."""
    if attention_instances is None:
        raise ValueError(f"{type(module).__name__} is not handed the fallback's attention "
                         "layers: its model does not pass keyword arguments on (`**kwargs`)")
    attn = attention_instances[module.layer_idx]
    _check_attention_arguments(module, attn, attention_mask, kwargs)
    if module.layer_idx in attention_instances.called:
        raise ValueError(f"{type(module).__name__} {module.layer_idx} attends more than once "
                         "per forward (a looped or shared layer): the KV cache holds one "
                         "attention per layer")
    attention_instances.called.add(module.layer_idx)
    t = query.size(2)
    # The module's own scaling is the backend's (as vLLM's): a model that pre-scales its
    # query passes 1.0 (OPT). It is the same at every call of a layer.
    attn.impl.scale = query.size(-1) ** -0.5 if scaling is None else scaling
    out = attn(*(x[0].transpose(0, 1).reshape(t, -1) for x in (query, key, value)))
    return out.view(1, t, attn.num_heads, attn.head_size), None


def _check_attention_arguments(module: nn.Module, attn: Attention,
                               attention_mask: torch.Tensor | None, kwargs: dict) -> None:
    where = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"{where} builds its own attention mask, which the transformers "
                         "fallback does not apply")
    for name, value in kwargs.items():
        if value is None or name in ("dropout", "position_ids", "cache_position",
                                     "output_attentions", "use_cache"):
            continue
        if name == "sliding_window" and value == attn.sliding_window:
            continue
        if name == "softcap" and value == attn.impl.logits_soft_cap:
            continue
        if name == "is_causal" and value:
            continue
        raise ValueError(f"{where} passes {name}={value!r} to the attention function, which "
                         "the transformers fallback does not honour")


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


def computes_as_llama_rms_norm(module: nn.Module) -> bool:
    """Whether `module`'s forward is Llama's RMSNorm, line for line (well over a hundred
    transformers classes copy it: Mistral, Qwen2, Granite …; Olmo 2's and Gemma's differ)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    source = forward_source(type(module))
    return source is not None and source == forward_source(LlamaRMSNorm)


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


class _HeadOnly:
    """`self` for a causal LM's forward in which the base model returns hidden states already
    computed: everything else (the LM head, config, buffers) is the model's own."""

    def __init__(self, hf: nn.Module, base_model_name: str, hidden: torch.Tensor) -> None:
        self.__dict__.update(_hf=hf, _base=base_model_name,
                             _stand_in=_BaseModelStandIn(_BaseModelOutput(hidden)))

    def __getattr__(self, name: str) -> Any:
        return self._stand_in if name == self._base else getattr(self._hf, name)


class _BaseModelStandIn:
    """Answers the base model's call, or a call of any of its parts (OPT's `model.decoder`),
    with the output already computed."""

    def __init__(self, output: "_BaseModelOutput") -> None:
        self.__dict__["_output"] = output

    def __call__(self, *args: Any, **kwargs: Any) -> "_BaseModelOutput":
        return self._output

    def __getattr__(self, name: str) -> "_BaseModelStandIn":
        return self


class _BaseModelOutput:
    """A base model's output holding only the last hidden states (the cache, attentions and
    the rest are None)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name: str) -> None:
        return None


class AttentionLayers(nn.ModuleList):
    """One `Attention` per layer, and the layers that have attended in the current forward."""

    def __init__(self, layers: Iterable[Attention]) -> None:
        super().__init__(layers)
        self.called: set[int] = set()


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
            raise ValueError(f"the transformers fallback cannot run {architecture}: "
                             f"{fallback_refusal(architecture)}")
        _register_attention()
        from transformers.initialization import no_init_weights
        config._attn_implementation = ATTENTION_NAME
        with no_init_weights():  # the loader fills every weight
            self.hf = cls._from_config(config, dtype=ctx.dtype)
        self.hf.tie_weights()
        self.hf.eval()
        use_platform_layers(self.hf, ctx)
        self.config = config
        self.base_model_name = base_model_name(self.hf)
        text = config.get_text_config()
        num_heads = text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        soft_cap = getattr(text, "attn_logit_softcapping", None)
        windows = {m.layer_idx: getattr(m, "sliding_window",
                                        layer_sliding_window(text, m.layer_idx))
                   for m in attention_modules(self.hf)}
        self.attention_instances = AttentionLayers(
            Attention(num_heads, head_size, 1.0, num_kv_heads, ctx,
                      windows.get(i, layer_sliding_window(text, i)), soft_cap)
            for i in range(text.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        base = getattr(self.hf, self.base_model_name)
        self.attention_instances.called.clear()
        out = base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                   attention_instances=self.attention_instances)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The causal LM's own forward with its base model's output replaced by `hidden`: its
        LM head and whatever follows it (Granite's `logits_scaling`, Cohere's `logit_scale`,
        Gemma's final soft-cap …) exactly as transformers runs them."""
        head = _HeadOnly(self.hf, self.base_model_name, hidden[None])
        ids = torch.zeros(1, hidden.size(0), dtype=torch.long, device=hidden.device)
        return type(self.hf).forward(head, input_ids=ids, use_cache=False).logits[0].float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors by their checkpoint names, converted as transformers converts
        them on load (its conversion mapping: renamings, the base model's prefix added or
        stripped, and the converters that stack per-expert tensors into one); returns our
        names of the parameters loaded, tied ones included. A converter's tensors are held
        until the checkpoint has been read, then converted by transformers' own operations."""
        import copy
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)
        mapping = get_model_conversion_mapping(self.hf)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        hf_params = dict(self.hf.named_parameters(remove_duplicate=False))
        buffers = {name for name, _ in self.hf.named_buffers()}
        pending: dict[str, WeightConverter] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            target, pattern = rename_source_key(name, renamings, converters,
                                                self.hf.base_model_prefix, hf_params)
            if target not in hf_params and name in hf_params:
                target, pattern = name, None
            if target in hf_params and pattern is not None:
                converter = pending.setdefault(target, copy.deepcopy(by_pattern[pattern]))
                converter.add_tensor(target, name, pattern, tensor)
            elif target in hf_params:
                default_weight_loader(hf_params[target], tensor)
                loaded.add(f"hf.{target}")
            elif target not in buffers and not target.endswith(".inv_freq"):
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self.hf).__name__} (the transformers fallback)")
        for target, converter in pending.items():
            for full_name, tensor in converter.convert(target, model=self.hf,
                                                       config=self.hf.config).items():
                tensor = tensor[0] if isinstance(tensor, list) else tensor
                default_weight_loader(hf_params[full_name], tensor)
                loaded.add(f"hf.{full_name}")
        return loaded | self._tied(loaded)

    def _tied(self, loaded: set[str]) -> set[str]:
        """Names that share storage with a loaded parameter (a tied LM head)."""
        by_storage: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            by_storage.setdefault(id(p), []).append(name)
        return {n for names in by_storage.values() if loaded & set(names) for n in names}

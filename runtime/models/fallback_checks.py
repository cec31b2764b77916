"""What the transformers fallback cannot run exactly as transformers does, found before
anything is allocated: the model is built on the meta device, its modules and their source
inspected, and one forward run with an attention function that only records its calls."""
from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
from typing import Any

import torch
from torch import nn


PROBE_NAME = "runtime-probe"  # the attention that records what a meta-device forward passes

# The names under which transformers hands a module its cache (attention's KV, or a mixer's
# recurrent state).
CACHE_ARGUMENTS = frozenset({"cache", "past_key_values", "past_key_value", "cache_params",
                             "layer_past", "state"})
# Arguments of the attention function that our Attention honours (the window and the soft-cap
# are checked against the layer's), or that do not change the result in eval.
HONOURED_ATTENTION_ARGUMENTS = frozenset({"attention_mask", "scaling", "dropout",
                                          "sliding_window", "softcap",
                                          "is_causal", "position_ids", "cache_position",
                                          "output_attentions", "use_cache"})
_ATTENTION_FEATURES = {
    "s_aux": "attention sinks (`s_aux`)", "sinks": "attention sinks (`sinks`)",
    "indices": "sparse attention over selected indices", "block_indices": "block-sparse attention",
    "position_bias": "a relative position bias added to the attention scores",
}


def fallback_refusal(architecture: str, config: Any | None = None) -> str | None:
    """Why the fallback cannot run `architecture` (with `config`, when given) exactly as
    transformers does, in a few words; None when it can."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if _is_multimodal(architecture, config):
        return "a vision-language model: not supported yet"
    if architecture not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return "not a transformers causal LM"
    cls = getattr(transformers, architecture, None)
    if cls is None:
        return f"this transformers ({transformers.__version__}) has no {architecture}"
    if config is None:
        return None if cls.is_backend_compatible() else _hand_written_reason(cls)
    text = config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ())
    if getattr(text, "attention_chunk_size", None) or "chunked_attention" in layer_types:
        return "chunked attention (`attention_chunk_size`): not supported yet"
    model = _meta_model(cls, config)
    if isinstance(model, str):
        return model
    stateful = _stateful_modules(model)
    recurrent = [n for n, m in stateful.items() if _keeps_recurrent_state(type(m))]
    if recurrent:
        return (f"needs the recurrent-state cache, not yet supported ({', '.join(recurrent)}: "
                f"state carried between steps)")
    if not cls.is_backend_compatible():
        return _hand_written_reason(cls)
    if stateful:
        return (f"{', '.join(stateful)} keep their own cache between steps (not attention's "
                f"KV): not supported yet")
    return _attention_refusal(model, text) or _probe_refusal(model)


def _is_multimodal(architecture: str, config: Any | None) -> bool:
    """A conditional-generation class, or a config with a tower or a separate text config."""
    if architecture.endswith("ForConditionalGeneration"):
        return True
    if config is None:
        return False
    towers = ("vision_config", "audio_config", "vision_tower", "visual")
    return (any(getattr(config, name, None) is not None for name in towers)
            or config.get_text_config() is not config)


def _hand_written_reason(cls: type) -> str:
    return (f"{cls.__name__} does not go through transformers' AttentionInterface (its "
            "attention or mixer is its own code)")


def _meta_model(cls: type, config: Any) -> nn.Module | str:
    """The model built on the meta device with the probe's attention, or why it cannot be
    built."""
    from transformers import AttentionInterface
    AttentionInterface.register(PROBE_NAME, _probe_attention_forward)
    config = copy.deepcopy(config)
    config._attn_implementation = PROBE_NAME
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as e:  # any config transformers cannot build: its own reason
        return (f"transformers cannot build it from this config ({type(e).__name__}: "
                f"{' '.join(str(e).split())})")


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _calls_attention_interface(cls: type) -> bool:
    source = forward_source(cls) or ""
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _stateful_modules(model: nn.Module) -> dict[str, nn.Module]:
    """By class name, the modules that use a cache themselves (they take one, no submodule of
    theirs does) without going through AttentionInterface."""
    takes_cache = {name for name, m in model.named_modules()
                   if _forward_parameters(type(m)) & CACHE_ARGUMENTS}
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name not in takes_cache or _calls_attention_interface(type(module)):
            continue
        prefix = f"{name}." if name else ""
        if not any(other.startswith(prefix) for other in takes_cache if other != name):
            found.setdefault(type(module).__name__, module)
    return found


_RECURRENT_STATE_WORDS = ("conv_state", "ssm_state", "recurrent_state", "state_size",
                          "time_mix", "wkv", "LightningAttention")


def _keeps_recurrent_state(cls: type) -> bool:
    """Whether a cache-reading module carries a recurrent (Mamba, conv, linear-attention or
    RWKV) state rather than keys and values."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return any(word in source for word in _RECURRENT_STATE_WORDS)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that hand their Q, K and V to the attention function, in layer order."""
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and _calls_attention_interface(type(m))]


def _reads_cache_length(module: nn.Module) -> bool:
    """Whether an attention module whose forward calls `get_seq_length` reaches that call:
    Llama 4's only on NoPE layers (`use_rope` false) with `attn_temperature_tuning`; any
    other module, always."""
    if hasattr(module, "attn_temperature_tuning") and hasattr(module, "use_rope"):
        return bool(module.attn_temperature_tuning) and not module.use_rope
    return True


def _attention_refusal(model: nn.Module, text: Any) -> str | None:
    modules = attention_modules(model)
    bidirectional = [type(m).__name__ for m in modules if getattr(m, "is_causal", True) is False]
    if bidirectional:
        return (f"{bidirectional[0]} attends both ways (`is_causal` is False; for a decoder, "
                "the config's `is_decoder`)")
    for cls in dict.fromkeys(type(m) for m in modules):
        if "get_seq_length" in (forward_source(cls) or "") and any(
                _reads_cache_length(m) for m in modules if type(m) is cls):
            return (f"{cls.__name__} reads token positions from its cache's length (Llama 4's "
                    "NoPE temperature tuning), which the fallback's flat batch does not give")
        calls = _attention_calls(cls)
        if len(calls) > 1:
            return (f"{cls.__name__} calls the attention function {len(calls)} times per layer "
                    "(differential attention): the KV cache holds one per layer")
        for name, value in (calls[0] if calls else {}).items():
            if name == "attention_mask" and value != "attention_mask":
                return f"{cls.__name__} builds its own attention mask (`{value}`)"
            if name == "is_causal" and value not in ("True", None):
                return f"{cls.__name__} runs bidirectional attention (`is_causal={value}`)"
            if name not in HONOURED_ATTENTION_ARGUMENTS:
                feature = _ATTENTION_FEATURES.get(name, f"the attention argument `{name}`")
                return f"{feature} in {cls.__name__}: not supported by the fallback yet"
    for m in modules:
        qk, v = getattr(m, "qk_head_dim", None), getattr(m, "v_head_dim", None)
        if qk is not None and v is not None and qk != v:
            return (f"multi-head latent attention (q/k heads of {qk}, v heads of {v}): the "
                    "fallback keeps full K/V, not the latent cache MLA needs (a native class "
                    "with an MLA backend does)")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    groups = sorted({getattr(m, "num_key_value_groups", heads // kv_heads) for m in modules})
    if groups != [heads // kv_heads]:
        return (f"K/V heads per layer ({', '.join(str(heads // g) for g in groups)}) that the "
                f"config does not state (`num_key_value_heads`: {kv_heads})")
    try:
        head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    except RuntimeError as e:  # a per-layer attribute (Gemma 4)
        return f"per-layer head sizes ({e})"
    sizes = sorted({getattr(m, "head_dim", head_size) for m in modules})
    if sizes != [head_size]:
        return (f"per-layer head sizes ({', '.join(map(str, sizes))}): the KV cache holds "
                f"one head size ({head_size}) for every layer")
    return None


@functools.cache
def _attention_calls(cls: type) -> list[dict[str, str]]:
    """Each call of the attention function in `cls.forward`: its keyword arguments (and the
    mask it passes, under "attention_mask") as source text."""
    source = forward_source(cls)
    if source is None:
        return []
    calls = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "attention_interface"):
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
            if len(node.args) > 4:
                keywords["attention_mask"] = ast.unparse(node.args[4])
            calls.append(keywords)
    return calls


def _probe_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    module.config.probe_record.append((module, attention_mask, kwargs))
    return query.transpose(1, 2), None


def _probe_refusal(model: nn.Module) -> str | None:
    """Runs the base model on the meta device with an attention that records its calls: a
    layer that attends twice (looped layers), a mask the model built, an argument we do not
    honour, or a layer that does not pass our arguments through is refused. A model whose
    forward cannot run on the meta device (data-dependent routing) is left to the checks
    made when it runs."""
    # (module, mask, kwargs) of each call; kwargs hold `record` itself under
    # "attention_instances" when the model passed its keyword arguments on
    record: list[tuple[nn.Module, torch.Tensor | None, dict]] = []
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    try:
        for module in attention_modules(model):
            module.config.probe_record = record
        getattr(model, base_model_name(model))(
            input_ids=ids, position_ids=torch.arange(4, device="meta")[None], use_cache=False,
            attention_instances=record)
    except Exception:  # not runnable on meta: the runtime checks remain
        return None
    seen: set[int] = set()
    for module, mask, kwargs in record:
        if kwargs.pop("attention_instances", None) is not record:
            return (f"{type(module).__name__} is not handed the arguments the model is called "
                    "with (`**kwargs`), which the fallback passes its attention layers in")
        where = type(module).__name__
        if module.layer_idx in seen:
            return (f"{where} {module.layer_idx} attends more than once per forward (looped "
                    "or shared layers): the KV cache holds one attention per layer")
        seen.add(module.layer_idx)
        if mask is not None:
            return f"{where} is given an attention mask the model builds itself"
        for name, value in kwargs.items():
            if value is not None and name not in HONOURED_ATTENTION_ARGUMENTS:
                return f"the attention argument `{name}` of {where}: not supported yet"
    return None


@functools.cache
def forward_source(cls: type) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def base_model_name(hf: nn.Module) -> str:
    """The attribute that holds the base model: `base_model_prefix`, or the one pretrained
    child when the prefix names none (Llama 4's "language_model" against its `model`)."""
    from transformers import PreTrainedModel
    prefix = hf.base_model_prefix
    if isinstance(getattr(hf, prefix, None), nn.Module):
        return prefix
    children = [n for n, m in hf.named_children() if isinstance(m, PreTrainedModel)]
    if len(children) != 1:
        raise ValueError(f"{type(hf).__name__} has no base model under {prefix!r}")
    return children[0]

"""Maps a Hugging Face architecture name to our implementation, plugins' additions included,
and decides between a native class and the transformers fallback (`model_impl`)."""
from __future__ import annotations

import importlib
from typing import Any

from runtime.config import MODEL_IMPLS
from runtime.model_config import ModelChoice
from runtime.plugins.manager import get_plugin_manager

_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "runtime.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "runtime.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "runtime.models.qwen:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "runtime.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "runtime.models.gemma:Gemma3ForCausalLM",
    "Gemma4ForCausalLM": "runtime.models.gemma4:Gemma4ForCausalLM",
    "GraniteForCausalLM": "runtime.models.granite:GraniteForCausalLM",
    "GraniteMoeForCausalLM": "runtime.models.granite:GraniteMoeForCausalLM",
    "Llama4ForCausalLM": "runtime.models.llama4:Llama4ForCausalLM",
    "Phi3ForCausalLM": "runtime.models.phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "runtime.models.moe:MixtralForCausalLM",
    "DeepseekV2ForCausalLM": "runtime.models.deepseek_v3:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "runtime.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Qwen2MoeForCausalLM": "runtime.models.moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "runtime.models.moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "runtime.models.gpt_oss:GptOssForCausalLM",
    # hybrids: recurrent layers beside attention (runtime.layers.recurrent_state)
    "Qwen3_5ForCausalLM": "runtime.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "runtime.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM": "runtime.models.qwen3_next:Qwen3NextForCausalLM",
    "MambaForCausalLM": "runtime.models.mamba:MambaForCausalLM",
    "Mamba2ForCausalLM": "runtime.models.mamba2:Mamba2ForCausalLM",
    "GraniteMoeHybridForCausalLM": "runtime.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "BambaForCausalLM": "runtime.models.bamba:BambaForCausalLM",
    "FalconH1ForCausalLM": "runtime.models.falcon_h1:FalconH1ForCausalLM",
    "JambaForCausalLM": "runtime.models.jamba:JambaForCausalLM",
    "NemotronHForCausalLM": "runtime.models.nemotron_h:NemotronHForCausalLM",
    "Lfm2ForCausalLM": "runtime.models.lfm2:Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM": "runtime.models.lfm2_moe:Lfm2MoeForCausalLM",
    "Zamba2ForCausalLM": "runtime.models.zamba2:Zamba2ForCausalLM",
    "KimiLinearForCausalLM": "runtime.models.kimi_linear:KimiLinearForCausalLM",
    # vision-language models (runtime.multimodal processes their images)
    "LlavaForConditionalGeneration": "runtime.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration":
        "runtime.models.llava_next:LlavaNextForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "runtime.models.mistral3:Mistral3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "runtime.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration":
        "runtime.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "runtime.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration":
        "runtime.models.qwen3_5_vl:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration":
        "runtime.models.qwen3_5_vl:Qwen3_5MoeForConditionalGeneration",
    "Idefics3ForConditionalGeneration":
        "runtime.models.idefics3:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "runtime.models.idefics3:SmolVLMForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "runtime.models.gemma3_mm:Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration": "runtime.models.gemma4_mm:Gemma4ForConditionalGeneration",
    # pooling models (runner="pooling"): encoders and classifiers
    "BertModel": "runtime.models.bert:BertModel",
    "BertForSequenceClassification": "runtime.models.bert:BertForSequenceClassification",
    "RobertaModel": "runtime.models.roberta:RobertaModel",
    "RobertaForSequenceClassification": "runtime.models.roberta:RobertaForSequenceClassification",
    "XLMRobertaModel": "runtime.models.roberta:XLMRobertaModel",
    "XLMRobertaForSequenceClassification":
        "runtime.models.roberta:XLMRobertaForSequenceClassification",
}

_FALLBACK = "runtime.models.transformers_fallback:TransformersForCausalLM"


def supported_architectures() -> dict[str, Any]:
    """Built-in architectures, then every plugin's `runtime_register_models` answer on top."""
    table: dict[str, Any] = dict(_BUILTIN)
    for answer in get_plugin_manager().hook.runtime_register_models():
        table.update(answer or {})
    return table


def _load(entry: Any) -> type:
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        return getattr(importlib.import_module(module), attr)
    return entry


def choose_model(architectures: list[str] | None, model_impl: str = "auto",
                 hf_config: Any | None = None) -> ModelChoice:
    """The class for config.json's `architectures`: a registered native class when there is
    one (and `model_impl` is not "transformers"), else the transformers fallback (unless
    `model_impl` is "native") when it runs the model exactly (checked against `hf_config`
    when given). Raises ValueError naming what is supported, and why the fallback refused,
    when neither fits."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, "
                         f"got {model_impl!r}")
    from runtime.models.fallback_checks import fallback_refusal
    table = supported_architectures()
    names = list(architectures or [])
    if model_impl != "transformers":
        for name in names:
            if name in table:
                return ModelChoice(name, "native", _load(table[name]),
                                   "a native class is registered" if model_impl == "auto"
                                   else "model_impl='native'")
    refusals: list[str] = []
    if model_impl != "native":
        for name in names:
            refusal = fallback_refusal(name, hf_config)
            if refusal is None:
                reason = ("model_impl='transformers'" if model_impl == "transformers"
                          else "no native class is registered")
                return ModelChoice(name, "transformers", _load(_FALLBACK), reason)
            refusals.append(refusal if len(names) == 1 else f"{name}: {refusal}")
    raise ValueError(unsupported_message(names, model_impl, sorted(table), refusals))


def unsupported_message(architectures: list[str], model_impl: str, native: list[str],
                        refusals: list[str] = ()) -> str:
    what = ", ".join(architectures) or "a config without `architectures`"
    fallback = ("" if model_impl == "native" or not refusals else
                f"; the transformers fallback cannot run it: {'; '.join(refusals)}")
    hint = " (try --model-impl transformers)" if model_impl == "native" else ""
    return (f"model architecture {what} is not supported with model_impl={model_impl!r}: "
            f"native classes: {', '.join(native)}{fallback}{hint}")


FALLBACK_ROW = ("any other transformers causal LM the fallback runs exactly (listed below)",
                "transformers fallback (one rank, unquantized)", "")


def architecture_table() -> list[tuple[str, str, str]]:
    """(architecture, implementation, GGUF `general.architecture`s, comma-separated, or "")
    for every registered architecture, then the fallback's row."""
    from runtime.model_loader.gguf_loader import HF_ARCHITECTURES
    gguf_of: dict[str, list[str]] = {}
    for arch, hf in HF_ARCHITECTURES.items():
        gguf_of.setdefault(hf, []).append(arch)
    rows = []
    for name, entry in sorted(supported_architectures().items()):
        where = entry.partition(":")[0] if isinstance(entry, str) else entry.__module__
        kind = "native" if name in _BUILTIN and entry == _BUILTIN[name] else "plugin"
        rows.append((name, f"{kind} (`{where}`)", ", ".join(gguf_of.get(name, []))))
    return rows + [FALLBACK_ROW]


def architecture_table_markdown() -> str:
    lines = ["| Architecture | Implementation | GGUF |", "| --- | --- | --- |"]
    for name, impl, gguf in architecture_table():
        files = ", ".join(f"`{arch}`" for arch in gguf.split(", ")) if gguf else ""
        lines.append(f"| {name if name == FALLBACK_ROW[0] else f'`{name}`'} | {impl} | "
                     f"{files} |")
    return "\n".join(lines)

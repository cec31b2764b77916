"""Which models pool, and the class that runs one as a pooling model."""
from __future__ import annotations

from typing import Any

from runtime.config import RUNNERS, EngineConfig
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource
from runtime.models.llama import LlamaForCausalLM
from runtime.models.decoder_embedding import as_embedding_model
from runtime.models.roberta import RobertaForSequenceClassification, RobertaModel
from runtime.pooling.pooler import is_sentence_transformers


def is_pooling_model(source: ModelSource, hf_config: Any) -> bool:
    """`runner="auto"`: a sentence-transformers folder, a `*ForSequenceClassification`, or an
    encoder (`BertModel`, `RobertaModel` …) pools; anything else generates."""
    if source.format != "gguf" and is_sentence_transformers(source.path):
        return True
    return any(name.endswith(("ForSequenceClassification", "Model"))
               and not name.endswith("LMHeadModel")  # GPT-2's causal LM is GPT2LMHeadModel
               for name in getattr(hf_config, "architectures", None) or [])


def resolve_runner(runner: str, source: ModelSource, hf_config: Any) -> str:
    """"pooling" or "generate" for `runner` ("auto" decides by the model)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    pools = is_pooling_model(source, hf_config)
    architecture = (getattr(hf_config, "architectures", None) or ["this model"])[0]
    if runner == "generate" and pools and not architecture.endswith("ForCausalLM"):
        raise ValueError(f"{architecture} is a pooling model (embeddings, classification): "
                         f"use runner='pooling' or 'auto'")
    if runner == "auto":
        return "pooling" if pools else "generate"
    return runner


def pooling_model_class(model_class: type) -> type:
    """The class that pools for a registered architecture: an encoder or classifier as it is, a
    Llama-family causal LM without its head (last-token embeddings)."""
    if hasattr(model_class, "encoder_only"):
        return model_class
    if issubclass(model_class, LlamaForCausalLM):
        return as_embedding_model(model_class)
    raise ValueError(f"{model_class.__name__} cannot run as a pooling model; encoders, "
                     f"*ForSequenceClassification and Llama-family decoders can")


def position_offset(model_class: type, hf_config: Any) -> int:
    """Where a prompt's positions start: RoBERTa-family encoders count from padding_idx + 1,
    so they hold that many positions fewer than max_position_embeddings."""
    if issubclass(model_class, (RobertaModel, RobertaForSequenceClassification)):
        return hf_config.pad_token_id + 1
    return 0


def is_encoder_only(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether the engine pools with an encoder, whose requests keep no KV and run whole.
    Pooling runs on one rank, eagerly; other settings are refused here."""
    if config.runner != "pooling":
        return False
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ValueError("pooling models run on one rank: tensor_parallel_size and "
                         "pipeline_parallel_size must be 1")
    if config.speculative_config is not None or config.enable_lora:
        raise ValueError("pooling models run without speculative decoding and LoRA")
    return pooling_model_class(model_config.choice.model_class).encoder_only

"""The pooling runner: loads an embedding / classification model and runs pooling requests.

Pooling requests are prefill-only: each is run whole in one step and keeps no KV, so a step is a
flat batch of whole requests (up to `max_num_batched_tokens` tokens and `max_num_seqs` requests)
whose attention runs in the backend's prefill-only mode (bidirectional for encoders).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from runtime.attention_backends.base import prefill_only_metadata
from runtime.config import EngineConfig
from runtime.forward_context import forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.custom_ops import CustomOps
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource, load_tokenizer
from runtime.models.bert import BertModel
from runtime.models.decoder_embedding import as_embedding_model
from runtime.models.llama import LlamaForCausalLM
from runtime.plugins.interfaces import ModelInfo
from runtime.plugins.manager import get_plugin_manager
from runtime.plugins.selection import select_platform
from runtime.pooling.pooler import finish_embedding, is_sentence_transformers, \
    load_pooler_config, pool
from runtime.pooling.params import PoolingParams
from runtime.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput,
                                     EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                     PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from runtime.worker.worker import Worker

RUNNERS = ("auto", "generate", "pooling")
POOLING_TASKS = ("embed", "classify", "token_embed")
PromptInput = str | list[int] | dict[str, Any]


def is_pooling_model(source: ModelSource, hf_config: Any) -> bool:
    """`runner="auto"`: a sentence-transformers folder, a `*ForSequenceClassification`, or an
    encoder (`BertModel`, `RobertaModel` …) pools; anything else generates."""
    if source.format != "gguf" and is_sentence_transformers(source.path):
        return True
    return any(name.endswith(("ForSequenceClassification", "Model"))
               and not name.endswith("LMHeadModel")  # GPT-2's causal LM is GPT2LMHeadModel
               for name in getattr(hf_config, "architectures", None) or [])


def resolve_runner(runner: str, source: ModelSource, hf_config: Any) -> str:
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


@dataclass
class Tokens:
    """One tokenized pooling input (a text, or a pair for a cross-encoder)."""

    ids: list[int]
    type_ids: list[int] | None = None


class PoolingEngine:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any) -> None:
        self.config = config
        platform = select_platform(config.device)
        platform.set_num_threads(config.num_threads)
        dtype = config.dtype or platform.default_dtype()
        mc = ModelConfig.from_hf(hf_config, dtype, config.max_model_len, config.model_impl)
        model_cls = pooling_model_class(mc.choice.model_class)
        self.encoder_only = model_cls.encoder_only
        hook = get_plugin_manager().hook
        info = ModelInfo(architecture=mc.architecture, dtype=dtype, kv_cache_dtype=dtype,
                         head_size=mc.head_size, num_heads=mc.num_heads,
                         num_kv_heads=mc.num_kv_heads, sliding_window=mc.sliding_window,
                         block_size=config.block_size, enforce_eager=True, pooling=True)
        backend = hook.runtime_attention_backend(platform=platform, model=info,
                                                 requested=config.attention_backend)
        if not getattr(backend, "supports_encoder_attention", False):
            raise ValueError(f"attention backend {getattr(backend, 'name', backend)} on "
                             f"{platform.name} has no prefill-only attention, which pooling "
                             f"models need (torch_paged has it: --attention-backend "
                             f"torch_paged)")
        worker = Worker(config, platform, source, mc)
        self.device = worker.device
        ctx = BuildContext(dtype=dtype, device=self.device, attention_backend=backend,
                           custom_op_provider=CustomOps(platform))
        self.model: nn.Module = worker.build_model(model_cls, hf_config, dtype, ctx, source)
        self.attention_backend = backend
        self.hidden_size = mc.hidden_size
        self.tokenizer = load_tokenizer(source, config.trust_remote_code)
        folder = source.path if os.path.isdir(source.path) else None
        self.pooler = load_pooler_config(folder, self.encoder_only)
        offset = next((m.position_offset for m in self.model.modules()
                       if isinstance(m, BertModel)), 0)
        self.max_model_len = min(mc.max_model_len - offset,
                                 self.pooler.max_seq_length or math.inf)
        self.num_labels = (getattr(hf_config, "num_labels", 0)
                           if hasattr(self.model, "classify") else 0)
        self._ids = itertools.count()

    @property
    def tasks(self) -> tuple[str, ...]:
        """What this model serves: classify (and cross-encoder score) with a classification
        head, embed (and embedding-similarity score) without."""
        return ("classify", "token_embed") if self.num_labels else ("embed", "token_embed")

    def check_task(self, task: str) -> None:
        if task not in self.tasks:
            raise ValueError(f"this model does not support {task!r}; it supports "
                             f"{', '.join(self.tasks)}")

    # inputs

    def tokenize(self, prompt: PromptInput, params: PoolingParams) -> Tokens:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            tokens = Tokens(self.tokenizer(prompt)["input_ids"])
        else:
            tokens = Tokens(self._check_ids(prompt))
        return self._truncate(tokens, params)

    def tokenize_pair(self, first: str, second: str, params: PoolingParams) -> Tokens:
        encoded = self.tokenizer(first, second)
        return self._truncate(Tokens(encoded["input_ids"], encoded.get("token_type_ids")),
                              params)

    def _check_ids(self, ids: Sequence[Any]) -> list[int]:
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab}), got {bad[0]!r}")
        return list(ids)

    def _truncate(self, tokens: Tokens, params: PoolingParams) -> Tokens:
        n, limit = len(tokens.ids), self.max_model_len
        if n == 0:
            raise ValueError("the input is empty: a pooling request needs at least one token")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = limit if keep == -1 else keep
            if keep > limit:
                raise ValueError(f"truncate_prompt_tokens {keep} exceeds the model's limit of "
                                 f"{limit} tokens")
            return Tokens(tokens.ids[-keep:],
                          tokens.type_ids[-keep:] if tokens.type_ids else None)
        if n > limit:
            raise ValueError(f"the input has {n} tokens, more than this model's limit of "
                             f"{limit}; shorten it or set truncate_prompt_tokens")
        return tokens

    def check_params(self, params: PoolingParams) -> None:
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(f"dimensions {params.dimensions} exceeds this model's embedding "
                             f"size {self.hidden_size}")

    # running

    def _batches(self, inputs: list[Tokens]) -> list[list[int]]:
        """Indices of `inputs` in steps of at most max_num_batched_tokens tokens (a longer
        input runs alone) and max_num_seqs requests; by length, so that a step's requests are
        alike (the attention pads them to the longest)."""
        steps, step, tokens = [], [], 0
        for i in sorted(range(len(inputs)), key=lambda i: len(inputs[i].ids)):
            t = inputs[i]
            if step and (tokens + len(t.ids) > self.config.max_num_batched_tokens
                         or len(step) == self.config.max_num_seqs):
                steps.append(step)
                step, tokens = [], 0
            step.append(i)
            tokens += len(t.ids)
        return steps + [step] if step else steps

    @torch.inference_mode()
    def _forward(self, inputs: list[Tokens]) -> tuple[torch.Tensor, list[int]]:
        """The last hidden states of one step's inputs, flat, and where each input starts."""
        lens = [len(t.ids) for t in inputs]
        dev = self.device
        ids = torch.tensor([i for t in inputs for i in t.ids], device=dev)
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        types = torch.tensor([i for t in inputs for i in (t.type_ids or [0] * len(t.ids))],
                             device=dev)
        metadata = prefill_only_metadata(lens, not self.encoder_only, dev)
        with forward_context(metadata):
            hidden = self.model(ids, positions, types)
        return hidden, metadata.query_start_loc_cpu

    def run(self, inputs: list[Tokens], task: str) -> list[torch.Tensor]:
        """Per input: its pooled hidden state (embed), its label logits (classify) or its
        hidden state per token (token_embed), in float32 on the host."""
        self.check_task(task)
        results: list[torch.Tensor | None] = [None] * len(inputs)
        for step in self._batches(inputs):
            hidden, starts = self._forward([inputs[i] for i in step])
            if task == "embed":
                rows = pool(hidden, starts, self.pooler.pooling_type)
            elif task == "classify":
                rows = self.model.classify(hidden[starts[:-1]])
            else:
                rows = [hidden[a:b] for a, b in zip(starts, starts[1:])]
            for i, row in zip(step, rows):
                results[i] = row.float().cpu()
        return results

    # tasks

    def _request_id(self) -> str:
        return f"pool-{next(self._ids)}"

    def encode(self, prompts: Sequence[PromptInput], params: Sequence[PoolingParams],
               task: str) -> list[PoolingRequestOutput]:
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, "
                             f"got {task!r}")
        inputs = self._prepare(prompts, params)
        data = self.run(inputs, task)
        if task == "embed":
            data = [self._finish(d, p) for d, p in zip(data, params)]
        return [PoolingRequestOutput(self._request_id(), PoolingOutput(d), t.ids)
                for d, t in zip(data, inputs)]

    def _prepare(self, prompts: Sequence[PromptInput],
                 params: Sequence[PoolingParams]) -> list[Tokens]:
        for p in params:
            self.check_params(p)
        return [self.tokenize(prompt, p) for prompt, p in zip(prompts, params)]

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return finish_embedding(vector, params.dimensions, normalize)

    def embed(self, prompts: Sequence[PromptInput],
              params: Sequence[PoolingParams]) -> list[EmbeddingRequestOutput]:
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()),
                                       o.prompt_token_ids)
                for o in self.encode(prompts, params, "embed")]

    def classify(self, prompts: Sequence[PromptInput],
                 params: Sequence[PoolingParams]) -> list[ClassificationRequestOutput]:
        return [ClassificationRequestOutput(
            o.request_id, ClassificationOutput(label_probs(o.outputs.data).tolist()),
            o.prompt_token_ids) for o in self.encode(prompts, params, "classify")]

    def score(self, first: Sequence[str], second: Sequence[str],
              params: PoolingParams) -> list[ScoringRequestOutput]:
        """Pairs (first[i], second[i]): a cross-encoder's relevance (sigmoid of its one logit)
        or the cosine similarity of the two embeddings."""
        self.check_params(params)
        if self.num_labels:
            if self.num_labels != 1:
                raise ValueError(f"scoring needs a cross-encoder with one label; this model "
                                 f"has {self.num_labels}")
            pairs = [self.tokenize_pair(a, b, params) for a, b in zip(first, second)]
            scores = [torch.sigmoid(x[0]).item() for x in self.run(pairs, "classify")]
            ids = [t.ids for t in pairs]
        else:
            texts = [self.tokenize(t, params) for t in [*first, *second]]
            vectors = [self._finish(v, params) for v in self.run(texts, "embed")]
            n = len(first)
            scores = [torch.cosine_similarity(vectors[i], vectors[n + i], dim=0).item()
                      for i in range(n)]
            ids = [texts[i].ids + texts[n + i].ids for i in range(n)]
        return [ScoringRequestOutput(self._request_id(), ScoringOutput(s), t)
                for s, t in zip(scores, ids)]


def label_probs(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's probabilities: softmax over its labels, sigmoid for a one-label head."""
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)


def pooling_model(config: EngineConfig) -> tuple[ModelSource, Any] | None:
    """The model's source and HF config when `config.runner` (or, for "auto", the model) says
    it pools; None for a generation model."""
    from runtime.model_loader.source import load_config, resolve_model
    source = resolve_model(config.model, config.tokenizer, config.revision, config.download_dir)
    hf_config = load_config(source, config.trust_remote_code)
    if resolve_runner(config.runner, source, hf_config) != "pooling":
        return None
    return source, hf_config


def open_pooling_engine(config: EngineConfig) -> PoolingEngine | None:
    """The pooling engine for a pooling model; None for a generation model."""
    found = pooling_model(config)
    return PoolingEngine(config, *found) if found else None


def prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (a string, token ids, a dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def params_list(params: PoolingParams | Sequence[PoolingParams] | None, n: int,
                truncate_prompt_tokens: int | None = None) -> list[PoolingParams]:
    """One PoolingParams per prompt (one for all, or one each); `truncate_prompt_tokens` fills
    those that leave it unset."""
    params = params or PoolingParams()
    params = [params] * n if isinstance(params, PoolingParams) else list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} pooling params for {n} prompts")
    if truncate_prompt_tokens is not None:
        params = [p if p.truncate_prompt_tokens is not None else
                  dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                  for p in params]
    return params

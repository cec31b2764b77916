"""The request side of pooling: prompts to validated token ids (with a cross-encoder's segment
ids) before the engine runs them, and the pooled tensors it returns to vLLM's output types."""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from runtime.config import EngineConfig
from runtime.model_loader.source import ModelSource, load_tokenizer
from runtime.models.registry import choose_model
from runtime.pooling.models import pooling_model_class, position_offset
from runtime.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput,
                                     EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                     PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from runtime.pooling.params import POOLING_TASKS, PoolingParams
from runtime.pooling.pooler import finish_embedding, load_pooler_config

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class PoolingInput:
    """One pooling request as the engine takes it: its id, token ids and params (task set)."""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams


class PoolingProcessor:
    """`max_model_len`: the engine's; a prompt may use what the model's positions allow of it
    (RoBERTa's start past padding_idx) and at most sentence-transformers' `max_seq_length`."""

    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any,
                 max_model_len: int) -> None:
        model_class = pooling_model_class(
            choose_model(getattr(hf_config, "architectures", None), config.model_impl)
            .model_class)
        self.encoder_only = model_class.encoder_only
        self.tokenizer = load_tokenizer(source, config.trust_remote_code)
        folder = source.path if os.path.isdir(source.path) else None
        self.pooler = load_pooler_config(folder, self.encoder_only)
        self.max_model_len = min(max_model_len - position_offset(model_class, hf_config),
                                 self.pooler.max_seq_length or math.inf)
        text = hf_config.get_text_config()
        self.hidden_size, self.vocab_size = text.hidden_size, text.vocab_size
        self.num_labels = (getattr(hf_config, "num_labels", 0)
                           if hasattr(model_class, "classify") else 0)
        self._ids = itertools.count()

    @property
    def tasks(self) -> tuple[str, ...]:
        """What this model serves: classify (and cross-encoder score) with a classification
        head, embed (and embedding-similarity score) without."""
        return ("classify", "token_embed") if self.num_labels else ("embed", "token_embed")

    def check_task(self, task: str) -> None:
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, "
                             f"got {task!r}")
        if task not in self.tasks:
            raise ValueError(f"this model does not support {task!r}; it supports "
                             f"{', '.join(self.tasks)}")

    def check_params(self, params: PoolingParams) -> None:
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(f"dimensions {params.dimensions} exceeds this model's embedding "
                             f"size {self.hidden_size}")

    # inputs

    def inputs(self, prompts: Sequence[PromptInput], params: Sequence[PoolingParams],
               task: str) -> list[PoolingInput]:
        """Every prompt validated (raising ValueError on the first bad one) before any runs."""
        self.check_task(task)
        for p in params:
            self.check_params(p)
        return [self._input(self._token_ids(prompt), None, p, task)
                for prompt, p in zip(prompts, params)]

    def score_inputs(self, first: Sequence[str], second: Sequence[str],
                     params: PoolingParams) -> list[PoolingInput]:
        """A cross-encoder's pairs (first[i], second[i]) to classify, or, for an embedding
        model, the texts of `first` then those of `second` to embed."""
        self.check_params(params)
        if not self.num_labels:
            return self.inputs([*first, *second], [params] * (len(first) + len(second)),
                               "embed")
        if self.num_labels != 1:
            raise ValueError(f"scoring needs a cross-encoder with one label; this model "
                             f"has {self.num_labels}")
        pairs = [self.tokenizer(a, b) for a, b in zip(first, second)]
        return [self._input(e["input_ids"], e.get("token_type_ids"), params, "classify")
                for e in pairs]

    def _token_ids(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {self.vocab_size}), "
                             f"got {bad[0]!r}")
        return list(prompt)

    def _input(self, ids: list[int], type_ids: list[int] | None, params: PoolingParams,
               task: str) -> PoolingInput:
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise ValueError("the input is empty: a pooling request needs at least one token")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = limit if keep == -1 else keep
            if keep > limit:
                raise ValueError(f"truncate_prompt_tokens {keep} exceeds the model's limit of "
                                 f"{limit} tokens")
            ids, type_ids = ids[-keep:], type_ids[-keep:] if type_ids else None
        elif n > limit:
            raise ValueError(f"the input has {n} tokens, more than this model's limit of "
                             f"{limit}; shorten it or set truncate_prompt_tokens")
        return PoolingInput(f"pool-{next(self._ids)}", ids, dataclasses.replace(
            params, task=task, token_type_ids=type_ids if type_ids and any(type_ids) else None))

    # outputs

    def pooling_outputs(self, inputs: list[PoolingInput],
                        results: list[torch.Tensor]) -> list[PoolingRequestOutput]:
        """The engine's results (the pooled vector, the label logits, or every token's hidden
        state), embeddings cut to `dimensions` and normalised as asked."""
        return [PoolingRequestOutput(i.request_id, PoolingOutput(
            self._finish(r, i.params) if i.params.task == "embed" else r), i.prompt_token_ids)
            for i, r in zip(inputs, results)]

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return finish_embedding(vector, params.dimensions, normalize)

    def embedding_outputs(self, inputs: list[PoolingInput],
                          results: list[torch.Tensor]) -> list[EmbeddingRequestOutput]:
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()),
                                       o.prompt_token_ids)
                for o in self.pooling_outputs(inputs, results)]

    def classification_outputs(self, inputs: list[PoolingInput], results: list[torch.Tensor]
                               ) -> list[ClassificationRequestOutput]:
        return [ClassificationRequestOutput(i.request_id, ClassificationOutput(
            label_probs(r).tolist()), i.prompt_token_ids) for i, r in zip(inputs, results)]

    def scoring_outputs(self, inputs: list[PoolingInput],
                        results: list[torch.Tensor]) -> list[ScoringRequestOutput]:
        """Each pair's score: a cross-encoder's relevance (sigmoid of its one logit) or the
        cosine similarity of the two embeddings."""
        if self.num_labels:
            return [ScoringRequestOutput(i.request_id, ScoringOutput(
                torch.sigmoid(r[0]).item()), i.prompt_token_ids)
                for i, r in zip(inputs, results)]
        vectors = [self._finish(r, i.params) for i, r in zip(inputs, results)]
        n = len(inputs) // 2
        return [ScoringRequestOutput(inputs[i].request_id, ScoringOutput(
            torch.cosine_similarity(vectors[i], vectors[n + i], dim=0).item()),
            inputs[i].prompt_token_ids + inputs[n + i].prompt_token_ids) for i in range(n)]


def label_probs(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's probabilities: softmax over its labels, sigmoid for a one-label head."""
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)


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

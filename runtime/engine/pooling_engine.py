"""The offline pooling engine behind `LLM.embed`, `classify`, `score` and `encode`: pooling
requests through an in-process engine core, the same scheduler and runner as generation."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from runtime.config import EngineConfig
from runtime.engine.core import EngineCore
from runtime.engine.llm_engine import build_core
from runtime.model_spec import ModelSpec
from runtime.pooling.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                                     PoolingRequestOutput, ScoringRequestOutput)
from runtime.pooling.params import PoolingParams
from runtime.pooling.processor import PoolingInput, PoolingProcessor, PromptInput
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams


def pooling_config(config: EngineConfig) -> EngineConfig:
    """The engine settings of a pooling model: no prefix caching (a cached prefix would leave
    its tokens' hidden states uncomputed, and mean pooling needs them)."""
    return dataclasses.replace(config, runner="pooling", enable_prefix_caching=False)


def pooling_request(item: PoolingInput, priority: int = 0) -> Request:
    """The core request of a pooling input (its sampling params go unused)."""
    return Request(item.request_id, item.prompt_token_ids, SamplingParams(), 0, priority,
                   pooling_params=item.params)


def by_length(inputs: list[PoolingInput]) -> list[PoolingInput]:
    """The order to queue a batch of inputs in: by length, as sentence-transformers' `encode`
    batches them, so that each step holds prompts of similar length (an encoder step's
    attention pads its requests to the longest)."""
    return sorted(inputs, key=lambda item: len(item.prompt_token_ids))


class PoolingEngine:
    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.config = pooling_config(config)
        self.spec = spec
        self.core: EngineCore = build_core(self.config, spec)
        self.processor = PoolingProcessor(self.config, spec.source, spec.hf_config,
                                          self.core.model_config.max_model_len)
        self.tokenizer = self.processor.tokenizer
        self.pooler = self.processor.pooler
        self.max_model_len = self.processor.max_model_len

    def run(self, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        """Step the core until every input is pooled; their results, in order."""
        for item in by_length(inputs):
            self.core.add_request(pooling_request(item))
        results: dict[str, torch.Tensor] = {}
        try:
            while len(results) < len(inputs):
                for out in self.core.step():
                    if out.pooling_output is not None:
                        results[out.request_id] = out.pooling_output.tensor()
        finally:
            for item in inputs:  # after an error, nothing of these stays in the core
                if item.request_id not in results:
                    self.core.finish_request(item.request_id, RequestStatus.FINISHED_ABORTED)
        return [results[item.request_id] for item in inputs]

    def encode(self, prompts: Sequence[PromptInput], params: Sequence[PoolingParams],
               task: str) -> list[PoolingRequestOutput]:
        inputs = self.processor.inputs(prompts, params, task)
        return self.processor.pooling_outputs(inputs, self.run(inputs))

    def embed(self, prompts: Sequence[PromptInput],
              params: Sequence[PoolingParams]) -> list[EmbeddingRequestOutput]:
        inputs = self.processor.inputs(prompts, params, "embed")
        return self.processor.embedding_outputs(inputs, self.run(inputs))

    def classify(self, prompts: Sequence[PromptInput],
                 params: Sequence[PoolingParams]) -> list[ClassificationRequestOutput]:
        inputs = self.processor.inputs(prompts, params, "classify")
        return self.processor.classification_outputs(inputs, self.run(inputs))

    def score(self, first: Sequence[str], second: Sequence[str],
              params: PoolingParams) -> list[ScoringRequestOutput]:
        """Pairs (first[i], second[i]): a cross-encoder's relevance (sigmoid of its one logit)
        or the cosine similarity of the two embeddings."""
        inputs = self.processor.score_inputs(first, second, params)
        return self.processor.scoring_outputs(inputs, self.run(inputs))

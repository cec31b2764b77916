"""What crosses from the engine to the workers each step, and back. Plain data, picklable.

The engine sends each request whole once (`NewRequestData`), then, while the workers hold it,
only what changed (`CachedRequestData`): so a step's message grows with the number of requests
scheduled, never with how long they have run. Each worker keeps the requests in a table
(`runtime.worker.request_states`) and builds its `ScheduledRequest`s from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runtime.lora.request import LoRARequest
from runtime.multimodal.inputs import MultiModalFeature, TensorData
from runtime.plugins.kv_connector import KVConnectorOutput
from runtime.pooling.params import PoolingParams
from runtime.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers do not hold: first scheduled, or resumed after a preemption."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before a preemption; [] for a new request
    params: SamplingParams
    sample_index: int
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits and blocks shared with an n > 1 sibling
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    pooling_params: PoolingParams | None = None  # set: a pooling request (runtime.pooling)
    state_slot: int | None = None  # its recurrent state slot (hybrid models)
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # the prompt's images
    prompt_embeds: TensorData | None = None  # a prompt given as embeddings: its rows


@dataclass
class CachedRequestData:
    """What changed in a request the workers hold since they last saw it."""

    request_id: str
    new_token_ids: list[int]  # appended to its sequence (the tokens sampled since)
    # Its block table is cut to `num_kept_blocks` (blocks freed when proposals were rejected),
    # then `new_block_ids` are appended.
    num_kept_blocks: int
    new_block_ids: list[int]
    num_computed_tokens: int  # lowered when proposals were rejected


@dataclass
class StepInput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step (proposals included), in schedule order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> proposed tokens to verify, scheduled after its own (absent: none)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> slots reserved past the step's tokens, for a draft model (absent: none)
    num_lookahead: dict[str, int] = field(default_factory=dict)
    # The workers drop these requests' state: preempted ones keep their sampling generator
    # (they come back whole, as new requests); finished or aborted ones keep nothing.
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Structured outputs: the allowed tokens of each constrained row sampled this step, int32
    # [rows, ceil(vocab / 32)] (bit t set: token t allowed), and each such request's first row
    # (a request verifying k proposals has k + 1 rows, in order).
    grammar_bitmask: np.ndarray | None = None
    grammar_rows: dict[str, int] = field(default_factory=dict)
    # A KV connector's orders for the step (its `build_connector_meta()`), and the blocks they
    # load into (the workers prepare those before the connector writes them)
    kv_connector_meta: Any = None
    kv_load_block_ids: list[int] = field(default_factory=list)
    # Encoder-cache entries the scheduler evicted: the workers drop their embeddings.
    evicted_encoder_ids: list[str] = field(default_factory=list)
    # Hybrid models' prefix caching: request id -> the checkpoint entry its state slot is
    # filled from before the step (admitted on a cached prefix), and request id ->
    # (position, entry) for each checkpoint the step makes (the state after that token).
    state_restores: dict[str, int] = field(default_factory=dict)
    state_checkpoints: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass
class ScheduledRequest:
    """One request's share of a step, as a worker builds it from its request table."""

    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0] (= computed tokens before the step)
    block_ids: list[int]
    sample: bool  # the step reaches the end of the known tokens, so a token is sampled
    params: SamplingParams
    sample_index: int
    num_prompt_tokens: int
    all_token_ids: list[int]  # prompt + output so far (read for penalties and prompt logprobs)
    # proposed tokens to verify: the tail of token_ids, past all_token_ids
    spec_token_ids: list[int] = field(default_factory=list)
    num_lookahead: int = 0  # slots reserved past token_ids (a draft model writes its KV there)
    # structured outputs: the allowed tokens of each sampled row (1 + len(spec_token_ids) rows)
    grammar_bitmask: np.ndarray | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    state_slot: int | None = None  # its recurrent state slot (hybrid models)
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # a prompt given as embeddings: [prompt tokens, hidden] on the host, its token ids
    # placeholders
    prompt_embeds: torch.Tensor | None = None
    restore_checkpoint: int | None = None  # the checkpoint entry its slot starts from
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (position, entry)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's tokens as penalties read them: none for an embeddings prompt (its
        ids are placeholders)."""
        return [] if self.prompt_embeds is not None else \
            self.all_token_ids[:self.num_prompt_tokens]


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled or prompt position: ids[0] is the chosen token."""

    ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class StepOutput:
    # accepted proposals, then the target's own token
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (position of the first entry, one entry per prompt position predicted)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals for next step
    # request id -> a pooling request's result, float32 on the host, in the step it finishes
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    # request id -> why it ends here with an error (its LoRA adapter could not be read)
    failed: dict[str, str] = field(default_factory=dict)
    # what the KV connector did on this rank (every rank's, merged by the executor)
    kv_connector_output: KVConnectorOutput | None = None

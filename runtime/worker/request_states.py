"""A worker's table of the requests it holds, kept in step with the engine's by each step's
message (runtime.core.messages); every rank applies the same messages, so every rank holds the
same table. The step's `ScheduledRequest`s are built from it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.lora.request import LoRARequest
from runtime.multimodal.inputs import MultiModalFeature
from runtime.pooling.params import PoolingParams
from runtime.sampling_params import SamplingParams
from runtime.core.messages import ScheduledRequest, StepInput


@dataclass
class RequestState:
    params: SamplingParams
    sample_index: int
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + output so far
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    state_slot: int | None = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    prompt_embeds: torch.Tensor | None = None


class RequestStates:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def apply(self, step: StepInput) -> list[ScheduledRequest]:
        """Bring the table up to date with `step`; the scheduled requests, in schedule order."""
        for request_id in step.preempted_ids + step.finished_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            self.requests[new.request_id] = RequestState(
                new.params, new.sample_index, len(new.prompt_token_ids),
                list(new.prompt_token_ids) + new.output_token_ids, list(new.block_ids),
                new.num_computed_tokens, new.lora_request, new.pooling_params, new.state_slot,
                new.mm_features,
                None if new.prompt_embeds is None else new.prompt_embeds.tensor())
        for change in step.cached_requests:
            state = self.requests[change.request_id]
            state.token_ids.extend(change.new_token_ids)
            del state.block_ids[change.num_kept_blocks:]
            state.block_ids.extend(change.new_block_ids)
            state.num_computed_tokens = change.num_computed_tokens
        return [self._scheduled(request_id, n, step)
                for request_id, n in step.num_scheduled_tokens.items()]

    def _scheduled(self, request_id: str, num_tokens: int, step: StepInput) -> ScheduledRequest:
        state = self.requests[request_id]
        start = state.num_computed_tokens
        spec = step.spec_token_ids.get(request_id, [])
        row = step.grammar_rows.get(request_id)
        return ScheduledRequest(
            request_id=request_id,
            token_ids=state.token_ids[start:start + num_tokens - len(spec)] + spec,
            start_pos=start, block_ids=state.block_ids,
            sample=start + num_tokens - len(spec) >= len(state.token_ids)
            and state.pooling_params is None,
            params=state.params, sample_index=state.sample_index,
            num_prompt_tokens=state.num_prompt_tokens, all_token_ids=state.token_ids,
            spec_token_ids=spec, num_lookahead=step.num_lookahead.get(request_id, 0),
            grammar_bitmask=None if row is None else
            step.grammar_bitmask[row:row + 1 + len(spec)], lora_request=state.lora_request,
            pooling_params=state.pooling_params, state_slot=state.state_slot,
            mm_features=state.mm_features, prompt_embeds=state.prompt_embeds,
            restore_checkpoint=step.state_restores.get(request_id),
            checkpoints=step.state_checkpoints.get(request_id, []))

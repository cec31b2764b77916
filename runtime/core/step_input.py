"""The message a schedule becomes for the workers: each request whole once, then only what
changed (the tokens appended since, the block-table change, the computed count), as vLLM V1's
scheduler output does. It remembers what the workers hold of each request to know the rest."""
from __future__ import annotations

from collections.abc import Iterable

from runtime.core.kv_cache_manager import KVCacheManager
from runtime.core.scheduler import SchedulerOutput
from runtime.request import Request
from runtime.core.messages import CachedRequestData, NewRequestData, StepInput


class StepInputBuilder:
    """`send_lookahead`: a draft model writes the KV of its proposals into slots reserved past
    the step's tokens, so each step says how many there are."""

    def __init__(self, kv: KVCacheManager, max_model_len: int, send_lookahead: bool) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.send_lookahead = send_lookahead
        self.num_sent_tokens: dict[str, int] = {}  # request id -> tokens the workers hold
        self._preempted: list[str] = []
        self._finished: list[str] = []

    def preempted(self, requests: Iterable[Request]) -> None:
        """The workers drop these requests (their blocks are gone); each comes back whole when
        it is scheduled again."""
        for r in requests:
            if self.num_sent_tokens.pop(r.request_id, None) is not None:
                self._preempted.append(r.request_id)

    def finished(self, request_ids: Iterable[str]) -> None:
        """The workers drop everything of these requests."""
        for request_id in request_ids:
            self.num_sent_tokens.pop(request_id, None)
            self._finished.append(request_id)

    def build(self, sched: SchedulerOutput) -> StepInput:
        step = StepInput(preempted_ids=self._preempted, finished_ids=self._finished,
                         evicted_encoder_ids=sched.evicted_encoder_ids)
        self._preempted, self._finished = [], []
        for r, n in sched.scheduled:
            step.num_scheduled_tokens[r.request_id] = n
            if r.spec_token_ids:
                step.spec_token_ids[r.request_id] = list(r.spec_token_ids)
            if self.send_lookahead:
                step.num_lookahead[r.request_id] = min(
                    len(r.block_ids) * self.kv.block_size, self.max_model_len) - \
                    (r.num_computed_tokens + n)
            restore = self.kv.take_restore(r)
            if restore is not None:
                step.state_restores[r.request_id] = restore
            orders = self.kv.take_checkpoint_orders(r)
            if orders:
                step.state_checkpoints[r.request_id] = orders
            num_sent = self.num_sent_tokens.get(r.request_id)
            num_kept, new_blocks = self.kv.take_block_changes(r)
            if num_sent is None:
                step.new_requests.append(NewRequestData(
                    request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids, params=r.params,
                    sample_index=r.sample_index, block_ids=list(r.block_ids),
                    num_computed_tokens=r.num_computed_tokens, lora_request=r.lora_request,
                    pooling_params=r.pooling_params, state_slot=r.state_slot,
                    mm_features=r.mm_features, prompt_embeds=r.prompt_embeds))
            else:
                step.cached_requests.append(CachedRequestData(
                    request_id=r.request_id, new_token_ids=r.all_token_ids[num_sent:],
                    num_kept_blocks=num_kept, new_block_ids=new_blocks,
                    num_computed_tokens=r.num_computed_tokens))
            self.num_sent_tokens[r.request_id] = r.num_tokens
        self.kv.checkpoints.end_step()
        return step

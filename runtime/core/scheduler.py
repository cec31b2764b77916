"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

Each step, running requests are served first (their next token, or the next chunk of a prompt),
then waiting requests are admitted while budget, sequence slots and KV blocks last. When blocks run
out, the least important running request is preempted: its blocks are freed and it goes back to
the waiting queue, to be recomputed (from the prefix cache where possible) later.

With `max_num_partial_prefills` N > 1 (vLLM's concurrent partial prefills), the prompts being
prefilled share a step: each chunk takes at most max_num_batched_tokens // n tokens, n the
prefills that can run now (at most N), and at most `max_long_partial_prefills` of them may be
long (more than `long_prefill_token_threshold` tokens left); a long prompt beyond that waits,
and the shorter ones behind it go first.

With speculative decoding, a running request's proposed tokens are scheduled after its own, as
ordinary tokens (budget, slots); `update` rolls back the rejected ones.

A prompt's images are encoded in the step whose chunk first reaches their placeholders, within
the encoder's own budget (`max_num_encoder_input_tokens`) and the encoder cache's room; a chunk
that would reach an image that fits neither stops before it. With `whole_mm_items` (vLLM's
disable_chunked_mm_input; a model whose image tokens attend to each other both ways) a chunk
never ends inside an image's placeholders: it stops before them, or waits.

Pooling requests are prompts only: each finishes in the step that computes its last prompt
token, and its blocks are freed then. An encoder's (`encoder_only`) hold no KV at all and are
never chunked: one longer than the budget runs alone, whole, in a step of its own.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from runtime.config import EngineConfig
from runtime.core.encoder_cache import EncoderCacheManager
from runtime.core.kv_cache_manager import KVCacheManager
from runtime.request import Request, RequestStatus
from runtime.core.spec_stats import SpecDecodeStats
from runtime.plugins.kv_connector import KVConnectorOutput, KVConnectorScheduler


@dataclass
class SchedulerOutput:
    """What to compute this step: for each scheduled request, how many new tokens."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # admitted requests whose next blocks a KV connector loads this step: (request, index of
    # the first loaded block, how many); they compute from the next step on
    loading: list[tuple[Request, int, int]] = field(default_factory=list)
    evicted_encoder_ids: list[str] = field(default_factory=list)  # the workers drop these

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.loading


class WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: a heap on
    (priority, arrival time), lower first, as vLLM orders them."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(list(self._fifo))
        return iter([entry[-1] for entry in sorted(self._heap)])

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._fifo.appendleft if front else self._fifo.append)(request)
        else:
            heapq.heappush(self._heap, (request.priority, request.arrival_time,
                                        next(self._counter), request))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][-1]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int,
                 encoder_only: bool = False,
                 connector: KVConnectorScheduler | None = None,
                 whole_mm_items: bool = False) -> None:
        self.config = config
        self.kv = kv
        self.connector: KVConnectorScheduler | None = None
        self.set_connector(connector)
        self.max_model_len = max_model_len
        self.encoder_only = encoder_only
        self.whole_mm_items = whole_mm_items
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Samples 1..n-1 of an n > 1 request wait here until sample 0 has computed the prompt,
        # then share its prompt blocks instead of computing the prompt again.
        self.held: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self.max_partial_prefills = config.max_num_partial_prefills
        self.long_prefill_threshold = config.long_prefill_token_threshold or \
            int(max_model_len * 0.04)  # vLLM's default
        self.spec = config.speculative_config
        self.spec_stats = SpecDecodeStats()
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)

    def set_connector(self, connector: KVConnectorScheduler | None) -> None:
        """Use this KV connector's scheduler side (--kv-transfer-config) from now on."""
        self.connector = connector
        self.kv.pool.on_evict = None if connector is None else connector.on_evict

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        leader = self.requests.get(request.leader_id) if request.leader_id else None
        if leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens:
            self.held.setdefault(leader.request_id, []).append(request)
        else:
            self.waiting.add(request)

    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(h) for h in self.held.values())

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting() > 0

    def _release_held(self, leader: Request) -> None:
        for sibling in reversed(self.held.pop(leader.request_id, [])):
            self.waiting.add(sibling, front=True)

    def _shared_or_cached_blocks(self, request: Request) -> list[int]:
        """Blocks a waiting request can adopt as computed: its leader's full prompt blocks
        (n > 1 siblings, with or without prefix caching), else its prefix-cache hits.

        Adopting happens at admission, so a waiting request never holds blocks. A hybrid
        model's siblings take the prefix cache's way: the leader checkpointed its state at the
        end of its prompt's last full block before the last token, and they resume there (with
        prefix caching off, they compute their prompt themselves).
        """
        leader = self.requests.get(request.leader_id) if request.leader_id else None
        if leader is not None and not self.kv.num_state_slots and \
                leader.status == RequestStatus.RUNNING and \
                leader.num_computed_tokens >= request.num_prompt_tokens:
            return leader.block_ids[:(request.num_prompt_tokens - 1) // self.kv.block_size]
        return self.kv.find_cached_blocks(request)

    def _admit_loading(self, request: Request, cached: list[int], num_computed: int,
                       out: SchedulerOutput) -> bool | None:
        """Admit `request` to have the blocks past its `num_computed` tokens that the KV
        connector holds loaded this step, with no compute; False when it has none or no room,
        None when the connector waits for them (the KV is on its way)."""
        if self.connector is None or self.requests.get(request.leader_id) is not None or \
                request.params.prompt_logprobs is not None:  # each prompt position computed
            return False
        num_external = self.connector.get_num_new_matched_tokens(request, num_computed)
        if num_external is None:
            return None
        if num_external == 0 or not self.kv.allocate_slots(request, num_external, cached):
            return False
        first = num_computed // self.kv.block_size
        self.kv.defer_indexing(request, first)
        num_blocks = num_external // self.kv.block_size
        self.connector.update_state_after_alloc(request, request.block_ids, first, num_blocks)
        out.loading.append((request, first, num_blocks))
        return True

    def _finish_loads(self, out: SchedulerOutput, output: KVConnectorOutput | None) -> None:
        """The loads of the step are done: each request counts what arrived as computed (a
        block that failed, on any rank, and those after it are computed again)."""
        output = output or KVConnectorOutput()
        self.connector.update_connector_output(output)
        for request, first, num_blocks in out.loading:
            failed = output.failed_loads.get(request.request_id)
            arrived = num_blocks if failed is None else max(0, failed - first)
            self.kv.index_loaded(request, first, arrived)
            request.num_cached_tokens = request.num_computed_tokens

    def _lora_fits(self, request: Request) -> bool:
        """Running requests use at most max_loras adapters, so every step fits the slots."""
        if request.lora_request is None:
            return True
        running = {r.lora_int_id for r in self.running} - {0}
        return request.lora_int_id in running or len(running) < self.config.max_loras

    def _victim(self) -> Request:
        """The running request to preempt: the latest arrival (FCFS) or the least important."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _lookahead(self, end: int) -> int:
        """Slots a draft model needs past a step's tokens (ending at `end`), for the KV of its
        proposals."""
        if self.spec is None or not self.spec.needs_lookahead:
            return 0
        return max(0, min(self.spec.num_speculative_tokens, self.max_model_len - end))

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > 1

    def _is_long(self, request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > self.long_prefill_threshold

    def _prefill_chunk(self) -> tuple[int, int]:
        """(the most tokens one prefill chunk takes this step, long prefills running) when
        max_num_partial_prefills > 1; else (the whole budget, 0)."""
        budget = self.config.max_num_batched_tokens
        if self.max_partial_prefills == 1:
            return budget, 0
        prefilling = [r for r in self.running if self._is_prefilling(r)]
        num_long = sum(map(self._is_long, prefilling))
        n, waiting_long = len(prefilling), 0
        for request in self.waiting:
            if n >= self.max_partial_prefills:
                break
            if self._is_long(request):
                if num_long + waiting_long >= self.config.max_long_partial_prefills:
                    continue
                waiting_long += 1
            n += 1
        return budget // max(1, min(n, self.max_partial_prefills)), num_long

    def _fit_encoder(self, request: Request, start: int, num_new: int,
                     budget: int) -> tuple[int, int]:
        """(`num_new` cut so that every image the chunk [start, start + num_new) reaches has
        its embeddings, cached or encoded this step, and with `whole_mm_items` ends past
        each image it reaches; the encoder budget left)."""
        cache = self.encoder_cache
        for i, feature in enumerate(request.mm_features):
            if not feature.overlaps(start, start + num_new):
                continue
            if self.whole_mm_items and start + num_new < feature.end:
                return max(0, feature.offset - start), budget
            if cache.in_use(request, i) or cache.hit(request, i):
                continue
            if feature.length > budget or not cache.can_allocate(feature.length):
                return max(0, feature.offset - start), budget
            cache.allocate(request, i)
            budget -= feature.length
        return num_new, budget

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self.encoder_cache.release(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.add(request, front=True)
        out.preempted.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        scheduled_ids: set[str] = set()
        chunk, num_long = self._prefill_chunk()
        encoder_budget = self.config.max_num_encoder_input_tokens

        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted by an earlier request this step
                continue
            num_new = min(request.num_tokens + len(request.spec_token_ids)
                          - request.num_computed_tokens, budget)
            if self._is_prefilling(request):
                num_new = min(num_new, chunk)
            if request.mm_features:
                num_new, encoder_budget = self._fit_encoder(
                    request, request.num_computed_tokens, num_new, encoder_budget)
            if num_new <= 0:
                continue
            # proposals the budget leaves out are dropped
            del request.spec_token_ids[max(0, request.num_computed_tokens + num_new
                                           - request.num_tokens):]
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead):
                victim = self._victim()
                if victim.request_id in scheduled_ids:
                    budget += next(n for r, n in out.scheduled if r is victim)
                    out.scheduled = [(r, n) for r, n in out.scheduled if r is not victim]
                    scheduled_ids.discard(victim.request_id)
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            out.scheduled.append((request, num_new))
            scheduled_ids.add(request.request_id)
            budget -= num_new

        # long prompts beyond max_long_partial_prefills, hybrids' prompts whose prefix this step
        # checkpoints, and those whose KV is on its way: they wait at the front
        passed_over: list[Request] = []
        while not out.preempted and budget > 0 and len(self.waiting) > 0 and \
                len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._lora_fits(request):
                break
            if self.max_partial_prefills > 1 and self._is_long(request):
                if num_long >= self.config.max_long_partial_prefills:
                    passed_over.append(self.waiting.pop())
                    continue
                num_long += 1
            if self.kv.num_state_slots and self.kv.resumes_deeper_next_step(request):
                passed_over.append(self.waiting.pop())  # resumes from this step's checkpoint
                continue
            cached = self._shared_or_cached_blocks(request)
            num_computed = request.num_computed_tokens + len(cached) * self.kv.block_size
            num_new = request.num_tokens - num_computed
            admitted = self._admit_loading(request, cached, num_computed, out)
            if admitted is None:  # its KV is on its way from another instance
                passed_over.append(self.waiting.pop())
                continue
            if admitted:
                self.waiting.pop()
                request.status = RequestStatus.RUNNING
                request.first_scheduled_time = time.monotonic()
                self.running.append(request)
                continue
            if self.encoder_only:
                if num_new > budget and out.scheduled:
                    break  # it runs whole, alone, next step
            else:
                if not chunked and num_new > budget:
                    break
                num_new = min(num_new, budget, chunk)
                if request.mm_features:
                    fitted, encoder_budget = self._fit_encoder(request, num_computed, num_new,
                                                               encoder_budget)
                    if fitted <= 0 or (not chunked and fitted < num_new):
                        break
                    num_new = fitted
                if not self.kv.allocate_slots(request, num_new, cached,
                                              self._lookahead(num_computed + num_new)):
                    break
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget = max(0, budget - num_new)
        for request in reversed(passed_over):
            self.waiting.add(request, front=True)

        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        out.evicted_encoder_ids = self.encoder_cache.take_evicted()
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]],
               drafts: dict[str, list[int]] | None = None,
               kv_connector_output: KVConnectorOutput | None = None) -> list[Request]:
        """Advance computed counts, append the sampled tokens, and retire finished requests.

        `sampled` maps a request id to the tokens it produced this step (none for a request
        whose prompt chunk did not reach its end): with speculative decoding, its accepted
        proposals and then one token of the target's. The rejected proposals are rolled back
        (computed count, blocks past the new end), and the tokens after one that finished its
        request are cut from `sampled`. `drafts` are the next step's proposals.
        `kv_connector_output` (with a KV connector) says which of the step's loads arrived.
        Returns the requests that finished.
        """
        if self.connector is not None:
            self._finish_loads(out, kv_connector_output)
        finished = []
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            if request.mm_features:
                self.encoder_cache.release(request, request.num_computed_tokens)
            tokens = sampled.get(request.request_id, ())
            if request.spec_token_ids:
                num_accepted = len(tokens) - 1
                request.num_computed_tokens -= len(request.spec_token_ids) - num_accepted
                self.spec_stats.observe(len(request.spec_token_ids), num_accepted)
                request.spec_token_ids = []
            for i, token_id in enumerate(tokens):
                request.append_token(token_id)
                if request.check_stop(self.max_model_len):
                    sampled[request.request_id] = tokens[:i + 1]  # what follows is dropped
                    break
            if request.request_id in self.held and \
                    request.num_computed_tokens >= request.num_prompt_tokens:
                self._release_held(request)
            if request.pooling_params is not None and \
                    request.num_computed_tokens >= request.num_prompt_tokens:
                request.status = RequestStatus.FINISHED_STOPPED  # pooled: nothing to generate
            if request.is_finished:
                self._retire(request)
                finished.append(request)
            elif self.spec is not None:
                self.kv.trim(request)
                # a step emits up to len(proposals) + 1 tokens: never more than the room left
                proposals = (drafts or {}).get(request.request_id, [])
                request.spec_token_ids = proposals[:max(0, request.room(self.max_model_len) - 1)]
        return finished

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> Request | None:
        """End a request from outside the step (a stop string, an abort)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request.leader_id in self.held and request in self.held[request.leader_id]:
            self.held[request.leader_id].remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.stop_reason = stop_reason
        self._retire(request)
        return request

    def _retire(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self._release_held(request)
        if self.connector is not None:  # before its blocks are freed
            request.finished_kv_transfer_params = self.connector.request_finished(
                request, request.block_ids)
        self.kv.free(request)
        self.encoder_cache.release(request)
        del self.requests[request.request_id]

"""Runs one step: brings its request table up to date with the step's message, builds the flat
batch from it on the host, runs the model, samples."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from runtime.attention_backends.context_parallel import ContextParallel
from runtime.batch import Batch, build_batch
from runtime.core.messages import ScheduledRequest, StepInput, StepOutput, TokenLogprobs
from runtime.distributed.pipeline import PipelineStage
from runtime.forward_context import forward_context, kv_connector_context
from runtime.layers.attention import PagedKVCache
from runtime.layers.recurrent_state import RecurrentStateCache
from runtime.plugins.interfaces import EagerRunner, GraphRunner
from runtime.plugins.kv_connector import KVConnectorWorker
from runtime.sampling.generators import SeededGenerators
from runtime.sampling.sampler import Sampler, SamplingBatch, gather_logprobs
from runtime.sampling_params import SamplingParams
from runtime.spec_decode.proposer import Proposer
from runtime.spec_decode.rejection import Verification, rejection_sample
from runtime.worker.encoder_runner import EncoderRunner
from runtime.worker.pooling_runner import PoolingRunner
from runtime.worker.prompt_embeds import merge_prompt_embeds
from runtime.worker.request_states import RequestStates
from runtime.worker.step_hooks import StepHook


class ModelRunner:
    """`hooks` join every step (`StepHook`: LoRA); a `proposer` (speculative decoding) joins
    it too and supplies the distributions its proposals are verified against; `pooling` (a
    pooling model) runs the step's forward and pools it instead of sampling."""

    def __init__(self, model: nn.Module, device: torch.device, block_size: int,
                 vocab_size: int, graph_runner: GraphRunner | None = None,
                 pp: PipelineStage | None = None,
                 hidden: tuple[int, torch.dtype] | None = None, *,
                 hooks: Sequence[StepHook] = (), proposer: Proposer | None = None,
                 pooling: PoolingRunner | None = None,
                 generators: SeededGenerators | None = None,
                 logits_processors: Sequence[Callable] = (),
                 greedy_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 dcp: ContextParallel | None = None) -> None:
        """`dcp`: this rank's place in its decode-context-parallel group (None: off); its
        cache then holds its shard of every context, `block_size` tokens per block."""
        self.model = model
        self.dcp = dcp
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        # the stage's place in the pipeline, and (hidden size, dtype) of what stages exchange
        self.pp = pp or PipelineStage()
        self.hidden = hidden
        self.sampler = Sampler(list(logits_processors), greedy_argmax)
        self.states = RequestStates()
        self.kv_cache = PagedKVCache(model)
        self.state_cache = RecurrentStateCache(model)  # a hybrid model's recurrent layers
        # seeded requests' generators (a draft model draws from them too): kept through a
        # preemption, dropped when they finish
        self.generators = generators or SeededGenerators(device)
        self.graph_runner = graph_runner or EagerRunner()
        # a KV connector whose per-layer hooks each attention layer calls (set by the worker)
        self.layer_connector: KVConnectorWorker | None = None
        self.proposer = proposer
        self.pooling = pooling
        # a multimodal model: its encoder cache and the merge of image embeddings
        self.encoder = EncoderRunner(model, device) if hasattr(model, "embed_multimodal") \
            else None
        # the proposer first: a hook after it (LoRA) may withdraw its proposals
        self.hooks: list[StepHook] = [h for h in (proposer, *hooks, pooling) if h is not None]

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype,
                          num_state_slots: int = 0, num_checkpoints: int = 0) -> None:
        """Give every attention layer its cache (and the draft model's, addressed by the same
        block ids), and every recurrent layer its `num_state_slots` state slots and
        `num_checkpoints` checkpoint entries in host memory."""
        self.kv_cache.allocate(num_blocks, self.block_size, dtype, self.device)
        self.state_cache.allocate(num_state_slots, self.device, num_checkpoints)
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        """Free the caches `allocate_kv_cache` gave (the draft model's: a cache of no blocks)."""
        self.kv_cache.release()
        self.state_cache.release()
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(0)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_reqs: int, dtype: torch.dtype) -> None:
        """The largest step the scheduler can form, run once to measure its memory peak.

        `num_tokens` prefill tokens split over `num_reqs` requests, on a scratch KV cache just
        big enough for them (freed afterwards), then the logits and log-softmax of one row per
        request (k + 1 when verifying k proposals), as sampling takes them (a pooling model
        takes none). A hybrid model's recurrent layers get a scratch state slot per request.
        """
        has_state = bool(self.state_cache.layers)
        bs = self.block_size
        sizes = sorted(num_tokens // num_reqs + (i < num_tokens % num_reqs)
                       for i in range(num_reqs))  # one-token requests first, as in a step
        reqs, next_block = [], 0
        for i, n in enumerate(sizes):
            blocks = list(range(next_block, next_block - (-n // bs)))
            next_block += len(blocks)
            reqs.append(ScheduledRequest(
                request_id=f"profile-{i}", token_ids=[0] * n, start_pos=0, block_ids=blocks,
                sample=True, params=SamplingParams(), sample_index=0, num_prompt_tokens=n,
                all_token_ids=[0] * n, state_slot=i if has_state else None))
        self.kv_cache.allocate(next_block, bs, dtype, self.device)
        self.state_cache.allocate(num_reqs if has_state else 0, self.device)
        batch = self._build(reqs)
        with forward_context(batch.metadata):
            hidden = self._forward(self.model, batch)
        if hidden is not None and self.pooling is None:  # None: a stage before the last
            rows = torch.as_tensor(batch.last_rows, device=self.device)
            if self.proposer is not None:  # each request verifies k + 1 rows
                rows = rows.repeat_interleave(1 + self.proposer.k)
            torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), -1)
        self.kv_cache.release()
        self.state_cache.release()

    def _build(self, reqs: list[ScheduledRequest]) -> Batch:
        """The step's batch over the target's cache, announced to the hooks."""
        self.kv_cache.zero_new_blocks(reqs)
        self.state_cache.zero_slots(r.state_slot for r in reqs
                                    if r.state_slot is not None and r.start_pos == 0)
        self.state_cache.restore([(r.state_slot, r.restore_checkpoint) for r in reqs
                                  if r.restore_checkpoint is not None])
        batch = build_batch(reqs, self.block_size, self.device, self.dcp)
        for hook in self.hooks:
            hook.before_forward(reqs, batch)
        return batch

    def _forward(self, forward: Callable[..., Any], batch: Batch,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """The model's final hidden states. A pipeline stage after the first starts from the
        previous stage's output; one before the last sends its output on and returns None.
        `inputs_embeds` (a step with image placeholders) replace the token ids' embeddings."""
        inputs: dict[str, Any] = {"input_ids": batch.input_ids, "positions": batch.positions}
        if inputs_embeds is not None:
            inputs["inputs_embeds"] = inputs_embeds
        if not self.pp.is_first:
            inputs["intermediate"] = self.pp.recv(batch.input_ids.size(0), *self.hidden,
                                                  self.device)
        out = forward(**inputs)
        if self.pp.is_last:
            return out
        self.pp.send(*out)
        return None

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        return self.generators.at(r.request_id, r.params, r.sample_index,
                                  len(r.all_token_ids) - r.num_prompt_tokens)

    def update_states(self, step: StepInput) -> list[ScheduledRequest]:
        """Apply the step's message to the request table; the step's requests, in schedule
        order. Every rank calls this with every message, whatever part of the step it runs."""
        self.generators.drop(step.finished_ids)
        if self.encoder is not None:
            self.encoder.evict(step.evicted_encoder_ids)
        gone = step.preempted_ids + step.finished_ids
        if gone:
            for hook in self.hooks:
                hook.finish(gone)
        return self.states.apply(step)

    @torch.inference_mode()
    def execute(self, reqs: list[ScheduledRequest]) -> StepOutput:
        out = StepOutput()
        if not reqs:
            return out
        if self.pooling is not None:
            out.pooled = self.pooling.execute(reqs, self._build)
            return out
        # Decodes first: the attention backend batches them.
        reqs = sorted(reqs, key=lambda r: len(r.token_ids) > 1)
        batch = self._build(reqs)
        embeds = None
        if self.encoder is not None:
            embeds = self.encoder.inputs_embeds(reqs, batch)
            positions = self.encoder.positions(reqs, batch)  # M-RoPE
            if positions is not None:
                batch.positions = positions
            if getattr(self.model, "mm_prefix_lm", False):
                batch.metadata.mm_prefix_ranges = self.encoder.mm_prefix_ranges(reqs)
        if self.pp.is_first:
            embeds = merge_prompt_embeds(self.model, reqs, batch, embeds)
        with forward_context(batch.metadata), kv_connector_context(self.layer_connector):
            # graph runners record token-id steps: a step with images or prompt embeddings,
            # or one whose layers call a KV connector, runs eagerly
            eager = embeds is not None or self.layer_connector is not None
            hidden = self._forward(self.model if eager else self.graph_runner.run, batch,
                                   embeds)
        if hidden is None:  # a pipeline stage before the last: it sent its output on
            return out
        cu = batch.query_start_loc
        self._prompt_logprobs(reqs, hidden, cu, out)
        sampling = [i for i, r in enumerate(reqs) if r.sample]
        if any(reqs[i].spec_token_ids for i in sampling):
            self._verify(reqs, sampling, hidden, cu, out)
        elif sampling:
            self._sample(reqs, sampling, hidden, cu, out)
        for hook in self.hooks:
            hook.after_sampling(reqs, out)
        return out

    def _sample(self, reqs: list[ScheduledRequest], sampling: list[int], hidden: torch.Tensor,
                cu: np.ndarray, out: StepOutput) -> None:
        """One token for each request in `sampling` (indices into `reqs`)."""
        rows = torch.tensor([int(cu[i + 1]) - 1 for i in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        sreqs = [reqs[i] for i in sampling]
        batch = SamplingBatch.build(
            [r.params for r in sreqs], [r.prompt_token_ids for r in sreqs],
            [r.all_token_ids[r.num_prompt_tokens:] for r in sreqs],
            [self._generator(r) for r in sreqs], self.device, self.vocab_size,
            [None if r.grammar_bitmask is None else r.grammar_bitmask[0] for r in sreqs])
        result = self.sampler(logits, batch, in_place=True)
        tokens = result.sampled_token_ids.tolist()
        if result.logprobs is not None:
            ids, values, ranks = (result.logprob_token_ids.tolist(), result.logprobs.tolist(),
                                  result.sampled_ranks.tolist())
        for j, r in enumerate(sreqs):
            out.sampled[r.request_id] = [tokens[j]]
            if r.params.logprobs is not None:
                k = r.params.logprobs + 1
                out.logprobs[r.request_id] = [TokenLogprobs(ids[j][:k], values[j][:k], ranks[j])]

    def _verify(self, reqs: list[ScheduledRequest], sampling: list[int], hidden: torch.Tensor,
                cu: np.ndarray, out: StepOutput) -> None:
        """Speculative step: each request in `sampling` verifies its k proposed tokens on the
        logits of its last k + 1 positions (k = 0 for requests without proposals), by
        rejection sampling; it emits its accepted proposals and one token of the target's."""
        rows, params, prompts, outputs, generators, checks = [], [], [], [], [], []
        bitmasks = []
        for i in sampling:
            r = reqs[i]
            k, end = len(r.spec_token_ids), int(cu[i + 1])
            generator = self._generator(r)
            checks.append(Verification(len(rows), r.spec_token_ids,
                                       self.proposer.draft_probs(r.request_id, k),
                                       r.params.greedy, generator))
            rows += range(end - 1 - k, end)
            history = r.all_token_ids[r.num_prompt_tokens:]
            for j in range(k + 1):  # row j follows the first j proposals
                params.append(r.params)
                prompts.append(r.prompt_token_ids)
                outputs.append(history + r.spec_token_ids[:j])
                generators.append(generator)
                bitmasks.append(None if r.grammar_bitmask is None else r.grammar_bitmask[j])
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        batch = SamplingBatch.build(params, prompts, outputs, generators, self.device,
                                    self.vocab_size, bitmasks)
        emitted = rejection_sample(self.sampler.adjust(logits, batch), batch, checks)
        wants = [j for j, i in enumerate(sampling) if reqs[i].params.logprobs is not None]
        if wants:
            sel = [checks[j].offset + t for j in wants for t in range(len(emitted[j]))]
            tokens = torch.tensor([t for j in wants for t in emitted[j]], device=self.device)
            ids, values, ranks = (x.tolist() for x in gather_logprobs(
                logits[sel].log_softmax(dim=-1), batch.max_num_logprobs, tokens))
            row = 0
            for j in wants:
                k = reqs[sampling[j]].params.logprobs + 1
                out.logprobs[reqs[sampling[j]].request_id] = [
                    TokenLogprobs(ids[row + t][:k], values[row + t][:k], ranks[row + t])
                    for t in range(len(emitted[j]))]
                row += len(emitted[j])
        for j, i in enumerate(sampling):
            out.sampled[reqs[i].request_id] = emitted[j]

    def _prompt_logprobs(self, reqs: list[ScheduledRequest], hidden: torch.Tensor,
                         cu: np.ndarray, out: StepOutput) -> None:
        """Logprobs of each prompt token given the tokens before it, for requests asking."""
        for i, r in enumerate(reqs):
            k = r.params.prompt_logprobs
            if k is None or r.start_pos >= r.num_prompt_tokens - 1:
                continue
            # position p predicts token p + 1; the prompt's last position predicts an output token
            end = min(r.start_pos + len(r.token_ids), r.num_prompt_tokens - 1)
            n = end - r.start_pos
            logits = self.model.compute_logits(hidden[int(cu[i]):int(cu[i]) + n])
            targets = torch.tensor(r.all_token_ids[r.start_pos + 1:end + 1], device=self.device)
            ids, values, ranks = gather_logprobs(torch.log_softmax(logits, -1), k, targets)
            entries = [TokenLogprobs(a, b, c) for a, b, c in
                       zip(ids.tolist(), values.tolist(), ranks.tolist())]
            out.prompt_logprobs[r.request_id] = (r.start_pos + 1, entries)

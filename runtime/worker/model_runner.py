"""Runs one step: brings its request table up to date with the step's message, builds the flat
batch from it on the host, runs the model, samples."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from runtime.attention_backends.base import AttentionMetadata
from runtime.distributed.pipeline import PipelineStage
from runtime.plugins.interfaces import EagerRunner, GraphRunner
from runtime.forward_context import forward_context
from runtime.layers.attention import Attention, zero_new_blocks
from runtime.sampling.sampler import (Sampler, SamplingBatch, gather_logprobs,
                                      plugin_logits_processors)
from runtime.sampling_params import SamplingParams
from runtime.spec_decode.rejection import Verification, rejection_sample
from runtime.worker.inputs import ScheduledRequest, StepInput, StepOutput, TokenLogprobs
from runtime.worker.request_states import RequestStates


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, block_size: int,
                 vocab_size: int, graph_runner: GraphRunner | None = None,
                 pp: PipelineStage | None = None,
                 hidden: tuple[int, torch.dtype] | None = None) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        # the stage's place in the pipeline, and (hidden size, dtype) of what stages exchange
        self.pp = pp or PipelineStage()
        self.hidden = hidden
        self.sampler = Sampler(plugin_logits_processors())
        self.states = RequestStates()
        # seeded requests' generators: kept through a preemption, dropped when they finish
        self.generators: dict[str, torch.Generator] = {}
        self.graph_runner = graph_runner or EagerRunner()
        # proposes tokens for speculative decoding (runtime.spec_decode); set by the worker
        self.proposer = None
        # puts each step's adapters in their slots (runtime.lora); set by the worker
        self.lora = None
        # runs and pools the steps of a pooling model (runtime.pooling); set by the worker
        self.pooling = None

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        """Give every attention layer its cache, in the layout its backend asks for.

        The memory is not touched here: zeroing gigabytes up front costs seconds of page
        faults. Blocks are zeroed when first handed out (see `_zero_new_blocks`), so attention
        never reads uninitialised memory past a sequence's end.
        """
        self.kv_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.kv_layers:
            shape = type(layer.impl).kv_cache_shape(num_blocks, self.block_size,
                                                    layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.empty(shape, dtype=dtype, device=self.device)
        self.num_zeroed_blocks = 0

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_reqs: int, dtype: torch.dtype) -> None:
        """The largest step the scheduler can form, run once to measure its memory peak.

        `num_tokens` prefill tokens split over `num_reqs` requests, on a scratch KV cache just
        big enough for them (freed afterwards), then the logits and log-softmax of one row per
        request (k + 1 when verifying k proposals), as sampling takes them (a pooling model
        takes none).
        """
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
                all_token_ids=[0] * n))
        self.allocate_kv_cache(next_block, dtype)
        self._zero_new_blocks(reqs)
        input_ids, positions, metadata, cu = self._prepare(reqs)
        with forward_context(metadata):
            hidden = self._forward(self.model, input_ids, positions)
        if hidden is not None and self.pooling is None:  # None: a stage before the last
            rows = torch.as_tensor(cu[1:] - 1, device=self.device)
            if self.proposer is not None:  # each request verifies k + 1 rows
                rows = rows.repeat_interleave(1 + self.proposer.k)
            torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), -1)
        for layer in self.kv_layers:
            layer.kv_cache = torch.empty(0)

    def _forward(self, forward: Callable[..., Any], input_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor | None:
        """The model's final hidden states. A pipeline stage after the first starts from the
        previous stage's output; one before the last sends its output on and returns None."""
        inputs: dict[str, Any] = {"input_ids": input_ids, "positions": positions}
        if not self.pp.is_first:
            inputs["intermediate"] = self.pp.recv(input_ids.size(0), *self.hidden, self.device)
        out = forward(**inputs)
        if self.pp.is_last:
            return out
        self.pp.send(*out)
        return None

    def _zero_new_blocks(self, reqs: list[ScheduledRequest]) -> None:
        self.num_zeroed_blocks = zero_new_blocks(self.kv_layers, reqs, self.num_zeroed_blocks)

    def _generator(self, req: ScheduledRequest) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(self.device)
            gen.manual_seed(req.params.seed + req.sample_index)
            self.generators[req.request_id] = gen
        return gen

    def _prepare(self, reqs: list[ScheduledRequest]):
        bs = self.block_size
        query_lens = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
        starts = np.array([r.start_pos for r in reqs], dtype=np.int64)
        seq_lens = starts + query_lens
        cu = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), np.int64, int(cu[-1]))
        # position of every token: its request's start + its offset within the request
        positions = np.repeat(starts - cu[:-1], query_lens) + np.arange(cu[-1])
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_tables = np.zeros((len(reqs), max_blocks), dtype=np.int32)
        for i, r in enumerate(reqs):
            block_tables[i, :len(r.block_ids)] = r.block_ids
        req_of_token = np.repeat(np.arange(len(reqs)), query_lens)
        slots = block_tables[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        if self.lora is not None:
            self.lora.prepare([r.lora_request for r in reqs], query_lens)
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_decode_tokens=int(np.argmax(query_lens > 1)) if (query_lens > 1).any()
            else len(reqs),
        )
        return (torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev),
                metadata, cu)

    def update_states(self, step: StepInput) -> list[ScheduledRequest]:
        """Apply the step's message to the request table; the step's requests, in schedule
        order. Every rank calls this with every message, whatever part of the step it runs."""
        for request_id in step.finished_ids:
            self.generators.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.drop(step.preempted_ids + step.finished_ids)
        if self.pooling is not None:
            self.pooling.drop(step.preempted_ids + step.finished_ids)
        return self.states.apply(step)

    @torch.inference_mode()
    def execute(self, reqs: list[ScheduledRequest]) -> StepOutput:
        out = StepOutput()
        if not reqs:
            return out
        if self.pooling is not None:
            out.pooled = self.pooling.execute(reqs, self)
            return out
        # Decodes first: the attention backend batches them.
        reqs = sorted(reqs, key=lambda r: len(r.token_ids) > 1)
        self._zero_new_blocks(reqs)
        input_ids, positions, metadata, cu = self._prepare(reqs)
        with forward_context(metadata):
            hidden = self._forward(self.graph_runner.run, input_ids, positions)
        if hidden is None:  # a pipeline stage before the last: it sent its output on
            return out
        self._prompt_logprobs(reqs, hidden, cu, out)
        sampling = [i for i, r in enumerate(reqs) if r.sample]
        if any(reqs[i].spec_token_ids for i in sampling):
            self._verify(reqs, sampling, hidden, cu, out)
        elif sampling:
            self._sample(reqs, sampling, hidden, cu, out)
        if self.proposer is not None:
            out.draft_token_ids = self.proposer.propose(reqs, out.sampled, self)
        if self.lora is not None:
            self.lora.fail_requests(reqs, out)
        return out

    def _sample(self, reqs: list[ScheduledRequest], sampling: list[int], hidden: torch.Tensor,
                cu: np.ndarray, out: StepOutput) -> None:
        """One token for each request in `sampling` (indices into `reqs`)."""
        rows = torch.tensor([int(cu[i + 1]) - 1 for i in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        sreqs = [reqs[i] for i in sampling]
        batch = SamplingBatch.build(
            [r.params for r in sreqs],
            [r.all_token_ids[:r.num_prompt_tokens] for r in sreqs],
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
                prompts.append(r.all_token_ids[:r.num_prompt_tokens])
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

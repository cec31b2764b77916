"""The draft-model proposer: a smaller model with the target's vocabulary proposes k tokens.

The draft keeps its own KV cache, addressed by the target's block tables: the same block ids
and slots, in tensors of the draft's own shape. Each step it first computes what the target
verified (the step's tokens less the rejected proposals, plus the token the target emitted),
then runs k - 1 one-token steps. So its cache holds valid KV wherever the target's does, prefix
caching and n > 1 block sharing included; the KV it writes for its own proposals lies past the
request's computed tokens, in slots the scheduler reserved (`num_lookahead`), and is rewritten
once the target has verified them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.batch import build_batch
from runtime.forward_context import forward_context
from runtime.layers.attention import PagedKVCache
from runtime.layers.build_context import BuildContext
from runtime.model_config import ModelConfig
from runtime.model_loader.build import build_model, model_info
from runtime.plugins.answers import PlatformAnswers
from runtime.sampling.batch import SamplingBatch
from runtime.sampling.generators import SeededGenerators
from runtime.sampling.sampler import argmax, exponential_race, random_probs
from runtime.config import EngineConfig
from runtime.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from runtime.core.messages import ScheduledRequest, StepOutput

logger = logging.getLogger(__name__)


class DraftModelProposer:
    """A step hook of the model runner (`runtime.worker.step_hooks`): after the target samples,
    it proposes the next step's tokens. `generators` are the runner's: a seeded request draws
    its proposals from its own generator."""

    def __init__(self, model: nn.Module, config: SpeculativeConfig, device: torch.device,
                 vocab_size: int, block_size: int, dtype: torch.dtype,
                 generators: SeededGenerators) -> None:
        self.model = model
        self.k = config.num_speculative_tokens
        self.device = device
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.dtype = dtype
        self.generators = generators
        self.kv_cache = PagedKVCache(model)
        self.kv_bytes_per_block = self.kv_cache.bytes_per_block(block_size, dtype)
        self.probs: dict[str, torch.Tensor] = {}  # request id -> [j, V] q of its proposals

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft's cache, in the target's block ids, in the model's dtype."""
        self.kv_cache.allocate(num_blocks, self.block_size, self.dtype, self.device)

    def before_forward(self, reqs: list[ScheduledRequest], batch: object) -> None:
        pass

    def after_sampling(self, reqs: list[ScheduledRequest], out: StepOutput) -> None:
        out.draft_token_ids = self.propose(reqs, out.sampled)

    def finish(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.probs.pop(request_id, None)

    def draft_probs(self, request_id: str, num_tokens: int) -> torch.Tensor | None:
        """The distributions the first `num_tokens` proposals of a random request were drawn
        from (None for greedy requests, which are verified by argmax)."""
        probs = self.probs.get(request_id)
        return None if probs is None else probs[:num_tokens]

    def _forward(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """Logits at the last position of each request (in `reqs` order, decodes first)."""
        self.kv_cache.zero_new_blocks(reqs)
        batch = build_batch(reqs, self.block_size, self.device)
        with forward_context(batch.metadata):
            hidden = self.model(batch.input_ids, batch.positions)
        rows = torch.as_tensor(batch.last_rows, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()

    def _draw(self, logits: torch.Tensor,
              reqs: list[ScheduledRequest]) -> tuple[list[int], torch.Tensor | None]:
        """One proposal per row: the argmax for greedy requests, else a draw from the draft's
        distribution under the request's temperature and filters (returned as q)."""
        params = [r.params for r in reqs]
        if all(p.greedy for p in params):
            return argmax(logits).tolist(), None
        empty = [[] for _ in reqs]
        generators = [self.generators.get(r.request_id, r.params, r.sample_index) for r in reqs]
        batch = SamplingBatch.build(params, empty, empty, generators, self.device,
                                    self.vocab_size)
        probs = random_probs(logits, batch)
        tokens = exponential_race(probs.clone(), batch.generators)
        if batch.greedy is not None:
            tokens = torch.where(batch.greedy, argmax(logits), tokens)
        return tokens.tolist(), probs

    @torch.inference_mode()
    def propose(self, reqs: list[ScheduledRequest],
                emitted: dict[str, list[int]]) -> dict[str, list[int]]:
        """Up to k proposals for each request that emitted tokens this step."""
        first, limits = [], {}
        for r in reqs:
            verified = r.token_ids[:len(r.token_ids) - len(r.spec_token_ids)]
            new = emitted.get(r.request_id, [])
            # slots exist for positions < end; the draft writes up to last + j - 1
            end = r.start_pos + len(r.token_ids) + r.num_lookahead
            tokens = (verified + new)[:end - r.start_pos]
            last = r.start_pos + len(tokens) - 1
            if new and len(tokens) == len(verified) + len(new) and end - last > 0:
                limits[r.request_id] = min(self.k, end - last)
            first.append(dataclasses.replace(r, token_ids=tokens, spec_token_ids=[]))
        first.sort(key=lambda r: len(r.token_ids) > 1)
        logits = self._forward(first)
        active = [(i, r) for i, r in enumerate(first) if r.request_id in limits]
        if not active:
            return {}
        reqs_now = [r for _, r in active]
        tokens, probs = self._draw(logits[[i for i, _ in active]], reqs_now)
        drafts = {r.request_id: [t] for r, t in zip(reqs_now, tokens)}
        dists = {r.request_id: [probs[j]] for j, r in enumerate(reqs_now)
                 if probs is not None and not r.params.greedy}
        positions = {r.request_id: r.start_pos + len(r.token_ids) for r in reqs_now}
        for step in range(1, self.k):
            reqs_now = [r for r in reqs_now if limits[r.request_id] > step]
            if not reqs_now:
                break
            batch = [dataclasses.replace(r, token_ids=[drafts[r.request_id][-1]],
                                         start_pos=positions[r.request_id] + step - 1)
                     for r in reqs_now]
            tokens, probs = self._draw(self._forward(batch), reqs_now)
            for j, (r, t) in enumerate(zip(reqs_now, tokens)):
                drafts[r.request_id].append(t)
                if r.request_id in dists:
                    dists[r.request_id].append(probs[j])
        self.probs.update({rid: torch.stack(q) for rid, q in dists.items()})
        return drafts


def load_draft_proposer(config: SpeculativeConfig, target: ModelConfig,
                        answers: PlatformAnswers, generators: SeededGenerators,
                        device: torch.device, block_size: int,
                        engine: EngineConfig) -> DraftModelProposer:
    """Build and load the draft model on the worker's device, unsharded, unquantized, with the
    worker's platform answers (its attention backend asked for the draft's shapes, the same
    custom ops and `linear` kernel) and the target's loading path; it is looked for where the
    target's model is (`engine`'s download dir)."""
    from runtime.model_spec import ModelSpec

    draft = ModelSpec.resolve_draft(config.model, engine, target.dtype)
    source, hf_config, mc = draft.source, draft.hf_config, draft.model_config
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {config.model} has a vocabulary of {mc.vocab_size} "
                         f"tokens, the target {target.vocab_size}: a draft model must share "
                         "the target's tokenizer and vocabulary")
    if mc.max_model_len < target.max_model_len:
        raise ValueError(f"the draft model {config.model} handles {mc.max_model_len} positions, "
                         f"fewer than the target's max_model_len {target.max_model_len}: "
                         "lower --max-model-len")
    backend = answers.attention_backend(model_info(mc, mc.dtype, block_size),
                                        about=f"draft model {mc.architecture}")
    ctx = BuildContext(dtype=mc.dtype, device=device, attention_backend=backend,
                       custom_op_provider=answers.custom_op)
    model = build_model(mc.choice.model_class, hf_config, ctx, source)
    logger.info("draft model %s (%s) proposes %d tokens per step", source.path,
                mc.architecture, config.num_speculative_tokens)
    return DraftModelProposer(model, config, device, mc.vocab_size, block_size, mc.dtype,
                              generators)

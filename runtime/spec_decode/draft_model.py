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

from runtime.forward_context import forward_context
from runtime.layers.attention import Attention, zero_new_blocks
from runtime.sampling.batch import SamplingBatch
from runtime.sampling.sampler import argmax, exponential_race, random_probs
from runtime.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from runtime.worker.inputs import ScheduledRequest
    from runtime.worker.model_runner import ModelRunner
    from runtime.worker.worker import Worker

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, model: nn.Module, config: SpeculativeConfig, device: torch.device,
                 vocab_size: int, kv_bytes_per_block: int) -> None:
        self.model = model
        self.k = config.num_speculative_tokens
        self.device = device
        self.vocab_size = vocab_size
        self.kv_bytes_per_block = kv_bytes_per_block
        self.kv_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.num_zeroed_blocks = 0
        self.probs: dict[str, torch.Tensor] = {}  # request id -> [j, V] q of its proposals

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        for layer in self.kv_layers:
            shape = type(layer.impl).kv_cache_shape(num_blocks, block_size, layer.num_kv_heads,
                                                    layer.head_size)
            layer.kv_cache = torch.empty(shape, dtype=dtype, device=self.device)
        self.num_zeroed_blocks = 0

    def draft_probs(self, request_id: str, num_tokens: int) -> torch.Tensor | None:
        """The distributions the first `num_tokens` proposals of a random request were drawn
        from (None for greedy requests, which are verified by argmax)."""
        probs = self.probs.get(request_id)
        return None if probs is None else probs[:num_tokens]

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.probs.pop(request_id, None)

    def _forward(self, reqs: list[ScheduledRequest], runner: "ModelRunner") -> torch.Tensor:
        """Logits at the last position of each request (in `reqs` order, decodes first)."""
        self.num_zeroed_blocks = zero_new_blocks(self.kv_layers, reqs, self.num_zeroed_blocks)
        input_ids, positions, metadata, cu = runner._prepare(reqs)
        with forward_context(metadata):
            hidden = self.model(input_ids, positions)
        rows = torch.as_tensor(cu[1:] - 1, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()

    def _draw(self, logits: torch.Tensor, reqs: list[ScheduledRequest],
              runner: "ModelRunner") -> tuple[list[int], torch.Tensor | None]:
        """One proposal per row: the argmax for greedy requests, else a draw from the draft's
        distribution under the request's temperature and filters (returned as q)."""
        params = [r.params for r in reqs]
        if all(p.greedy for p in params):
            return argmax(logits).tolist(), None
        empty = [[] for _ in reqs]
        batch = SamplingBatch.build(params, empty, empty, [runner._generator(r) for r in reqs],
                                    self.device, self.vocab_size)
        probs = random_probs(logits, batch)
        tokens = exponential_race(probs.clone(), batch.generators)
        if batch.greedy is not None:
            tokens = torch.where(batch.greedy, argmax(logits), tokens)
        return tokens.tolist(), probs

    @torch.inference_mode()
    def propose(self, reqs: list[ScheduledRequest], emitted: dict[str, list[int]],
                runner: "ModelRunner") -> dict[str, list[int]]:
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
        logits = self._forward(first, runner)
        active = [(i, r) for i, r in enumerate(first) if r.request_id in limits]
        if not active:
            return {}
        reqs_now = [r for _, r in active]
        tokens, probs = self._draw(logits[[i for i, _ in active]], reqs_now, runner)
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
            tokens, probs = self._draw(self._forward(batch, runner), reqs_now, runner)
            for j, (r, t) in enumerate(zip(reqs_now, tokens)):
                drafts[r.request_id].append(t)
                if r.request_id in dists:
                    dists[r.request_id].append(probs[j])
        self.probs.update({rid: torch.stack(q) for rid, q in dists.items()})
        return drafts


def load_draft_proposer(worker: "Worker", config: SpeculativeConfig) -> DraftModelProposer:
    """Build and load the draft model on the worker's device, unsharded, unquantized, through
    the worker's own loading path (the platform's custom ops and `linear` kernel included)."""
    from runtime.layers.build_context import BuildContext
    from runtime.layers.custom_ops import CustomOps
    from runtime.model_spec import ModelSpec
    from runtime.plugins.interfaces import ModelInfo

    target = worker.model_config
    draft = ModelSpec.resolve_draft(config.model, worker.config, target.dtype)
    source, hf_config, mc = draft.source, draft.hf_config, draft.model_config
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {config.model} has a vocabulary of {mc.vocab_size} "
                         f"tokens, the target {target.vocab_size}: a draft model must share "
                         "the target's tokenizer and vocabulary")
    if mc.max_model_len < target.max_model_len:
        raise ValueError(f"the draft model {config.model} handles {mc.max_model_len} positions, "
                         f"fewer than the target's max_model_len {target.max_model_len}: "
                         "lower --max-model-len")
    info = ModelInfo(architecture=mc.architecture, dtype=mc.dtype, kv_cache_dtype=mc.dtype,
                     head_size=mc.head_size, num_heads=mc.num_heads,
                     num_kv_heads=mc.num_kv_heads, sliding_window=mc.sliding_window,
                     block_size=worker.config.block_size)
    backend = worker.hook.runtime_attention_backend(platform=worker.platform, model=info,
                                                    requested=worker.config.attention_backend)
    ctx = BuildContext(dtype=mc.dtype, device=worker.device, attention_backend=backend,
                       custom_op_provider=CustomOps(worker.platform))
    model = worker.build_model(mc.choice.model_class, hf_config, mc.dtype, ctx, source)
    logger.info("draft model %s (%s) proposes %d tokens per step", source.path,
                mc.architecture, config.num_speculative_tokens)
    return DraftModelProposer(model, config, worker.device, mc.vocab_size,
                              mc.kv_bytes_per_block(worker.config.block_size, mc.dtype))

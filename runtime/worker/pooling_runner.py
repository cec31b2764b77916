"""The worker's side of pooling: runs a step of pooling requests through the model and pools
the hidden states of those whose prompt the step completes.

An encoder's requests run whole (the scheduler never splits them) in the backend's prefill-only
mode: bidirectional, no KV cache. A decoder embedder's run as ordinary prompt chunks over the
paged KV cache, so a prompt longer than the step's token budget spans several steps; the hidden
states of its earlier chunks are kept here until its last chunk, then pooled with it.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from runtime.attention_backends.base import prefill_only_metadata
from runtime.batch import Batch
from runtime.core.messages import ScheduledRequest, StepOutput
from runtime.forward_context import forward_context
from runtime.pooling.pooler import PoolerConfig, pool_rows


class PoolingRunner:
    def __init__(self, model: nn.Module, pooler: PoolerConfig, encoder_only: bool,
                 device: torch.device) -> None:
        self.model = model
        self.pooler = pooler
        self.encoder_only = encoder_only
        self.device = device
        self.partial: dict[str, list[torch.Tensor]] = {}  # earlier chunks' hidden states

    def before_forward(self, reqs: list[ScheduledRequest], batch: Batch) -> None:
        pass

    def after_sampling(self, reqs: list[ScheduledRequest], out: StepOutput) -> None:
        pass

    def finish(self, request_ids: list[str]) -> None:
        """Forget preempted (recomputed from the start) and finished requests."""
        for request_id in request_ids:
            self.partial.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, reqs: list[ScheduledRequest],
                build: Callable[[list[ScheduledRequest]], Batch]) -> dict[str, torch.Tensor]:
        """Run the step (a decoder's over the paged cache, its batch made by `build`, the
        runner's); per request whose prompt it completes, the pooled result in float32 on the
        host: the pooled vector (embed), the label logits (classify) or every token's hidden
        state (token_embed)."""
        if self.encoder_only:
            lens = [len(r.token_ids) for r in reqs]
            metadata = prefill_only_metadata(lens, False, self.device)
            cu = metadata.query_start_loc_cpu
            input_ids = torch.from_numpy(np.fromiter(
                (t for r in reqs for t in r.token_ids), np.int64, cu[-1])).to(self.device)
            positions = torch.from_numpy(
                np.arange(cu[-1]) - np.repeat(np.asarray(cu[:-1]), lens)).to(self.device)
        else:
            batch = build(reqs)
            input_ids, positions, metadata = batch.input_ids, batch.positions, batch.metadata
            cu = batch.query_start_loc.tolist()
        with forward_context(metadata):
            hidden = self.model(input_ids, positions, self._token_types(reqs, self.device))
        done: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for i, r in enumerate(reqs):
            rows = hidden[cu[i]:cu[i + 1]]
            if r.start_pos + len(r.token_ids) < r.num_prompt_tokens:
                self.partial.setdefault(r.request_id, []).append(rows.clone())
                continue
            earlier = self.partial.pop(r.request_id, [])
            rows = torch.cat([*earlier, rows]) if earlier else rows
            done.setdefault(r.pooling_params.task, []).append((r.request_id, rows))
        pooled = {}
        for task, items in done.items():
            rows = [x for _, x in items]
            if task == "embed":
                results = pool_rows(rows, self.pooler.pooling_type).float().cpu()
            elif task == "classify":
                results = self.model.classify(torch.stack([x[0] for x in rows])).float().cpu()
            else:
                results = [x.float().cpu() for x in rows]
            for (request_id, _), result in zip(items, results):
                pooled[request_id] = result
        return pooled

    @staticmethod
    def _token_types(reqs: list[ScheduledRequest], device: torch.device) -> torch.Tensor | None:
        """The segment of each token (a cross-encoder's text pairs); None: all segment 0."""
        if not any(r.pooling_params.token_type_ids for r in reqs):
            return None
        types = [t for r in reqs for t in (
            r.pooling_params.token_type_ids or [0] * r.num_prompt_tokens
        )[r.start_pos:r.start_pos + len(r.token_ids)]]
        return torch.tensor(types, device=device)

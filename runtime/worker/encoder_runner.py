"""The worker's side of multimodal inputs: the encoder cache's embeddings, the vision encoder
run for the items a step reaches that the cache lacks, and the merge of their embeddings into
the step's input embeddings at their placeholders' rows.

The scheduler decides which entries exist (`evicted_encoder_ids` in each step's message); an
item is encoded here the first time a step's chunk overlaps its placeholders, and a chunk may
cover only part of them: each step takes the rows of the embeddings its tokens need.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runtime.batch import Batch
from runtime.core.messages import ScheduledRequest
from runtime.multimodal.embeds import EMBEDS_KEY
from runtime.multimodal.inputs import MultiModalFeature
from runtime.multimodal.mrope import mrope_positions


class EncoderRunner:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}  # identifier -> [length, hidden] embeddings
        self.num_encoded_items = 0

    def evict(self, identifiers: list[str]) -> None:
        for identifier in identifiers:
            self.cache.pop(identifier, None)

    def inputs_embeds(self, reqs: list[ScheduledRequest], batch: Batch) -> torch.Tensor | None:
        """The step's input embeddings with the images' rows filled in; None when no token of
        the step is an image placeholder (the model embeds the token ids itself)."""
        spans = []  # (feature, first placeholder row of the item used, first batch row, count)
        for i, r in enumerate(reqs):
            start, end = r.start_pos, r.start_pos + len(r.token_ids)
            for feature in r.mm_features:
                if feature.overlaps(start, end):
                    lo, hi = max(start, feature.offset), min(end, feature.end)
                    spans.append((feature, lo - feature.offset,
                                  int(batch.query_start_loc[i]) + lo - start, hi - lo))
        if not spans:
            return None
        self._encode_missing([s[0] for s in spans])
        rows = np.concatenate([np.arange(row, row + n) for _, _, row, n in spans])
        embeds = self.model.embed_input_ids(batch.input_ids)
        embeds[torch.from_numpy(rows).to(self.device)] = torch.cat(
            [self.cache[f.identifier][first:first + n] for f, first, _, n in spans]
        ).to(embeds.dtype)
        return embeds

    def mm_prefix_ranges(self, reqs: list[ScheduledRequest]
                         ) -> list[list[tuple[int, int]]] | None:
        """Per request, the [start, end) positions of the images its chunk reaches (the
        attention backend lets their tokens attend both ways); None when no chunk reaches
        one."""
        ranges = [[(f.offset, f.end) for f in r.mm_features
                   if f.overlaps(r.start_pos, r.start_pos + len(r.token_ids))] for r in reqs]
        return ranges if any(ranges) else None

    def positions(self, reqs: list[ScheduledRequest], batch: Batch) -> torch.Tensor | None:
        """The step's positions for an M-RoPE model when a request has items: [3, T] when a
        chunk reaches an item's placeholders, else [T] (text: the three rows are equal);
        None when no request has items (the batch's own positions hold)."""
        if not any(r.mm_features and r.mm_features[0].mrope_grid for r in reqs):
            return None
        cu = batch.query_start_loc
        out = np.empty((3, int(cu[-1])), dtype=np.int64)
        spans = False
        for i, r in enumerate(reqs):
            start, end = r.start_pos, r.start_pos + len(r.token_ids)
            out[:, cu[i]:cu[i + 1]] = mrope_positions(r.mm_features, start, end) \
                if r.mm_features else np.arange(start, end)
            spans = spans or any(f.overlaps(start, end) for f in r.mm_features)
        return torch.from_numpy(out if spans else out[0]).to(self.device)

    def _encode_missing(self, features: list[MultiModalFeature]) -> None:
        missing = list({f.identifier: f for f in features
                        if f.identifier not in self.cache}.values())
        for feature in missing:  # given as embeddings (runtime.multimodal.embeds)
            if EMBEDS_KEY in feature.data:
                self.cache[feature.identifier] = feature.data[EMBEDS_KEY].tensor().to(
                    self.device)
        missing = [f for f in missing if EMBEDS_KEY not in f.data]
        if not missing:
            return
        outputs = self.model.embed_multimodal(
            [{k: v.to(self.device) for k, v in f.tensors().items()} for f in missing])
        for feature, embeddings in zip(missing, outputs):
            if embeddings.size(0) != feature.length:
                raise RuntimeError(f"the encoder gave {embeddings.size(0)} embeddings for an "
                                   f"item of {feature.length} placeholders")
            self.cache[feature.identifier] = embeddings
        self.num_encoded_items += len(missing)

"""Seeded requests' random generators, one per request, kept across steps and preemptions."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from runtime.sampling_params import SamplingParams


class SeededGenerators:
    """A request with a `seed` draws from its own generator, seeded with `seed + sample_index`
    (one stream per sample of an n > 1 request); the target's sampler and a draft model draw
    from the same one, so a seeded run is reproducible whatever the batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def get(self, request_id: str, params: SamplingParams,
            sample_index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(self.device)
            gen.manual_seed(params.seed + sample_index)
            self._generators[request_id] = gen
        return gen

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

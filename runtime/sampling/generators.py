"""Seeded requests' random generators, one per request, re-seeded at each step from the
request's seed and output position, so a run is reproducible whatever the batch, preemptions
or a restarted engine core."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from runtime.sampling_params import SamplingParams


def step_seed(seed: int, sample_index: int, position: int) -> int:
    """The generator seed of the step that samples output token `position` of sample
    `sample_index`: a hash, so that nearby seeds, samples and positions give unrelated
    streams."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}:{position}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1  # torch takes < 2**63 signed


class SeededGenerators:
    """A request with a `seed` draws from its own generator. `at` re-seeds it for the step
    that samples the request's output token `position` (every draw of that step, the target's
    sampler then a draft model's proposals, comes from it), so the tokens of a seeded request
    depend only on its seed and its tokens so far: a request re-admitted with its generated
    tokens, after a preemption or onto a new engine core, continues exactly."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def at(self, request_id: str, params: SamplingParams, sample_index: int,
           position: int) -> torch.Generator | None:
        """The request's generator, seeded for the step that samples output `position`."""
        gen = self.get(request_id, params, sample_index)
        if gen is not None:
            gen.manual_seed(step_seed(params.seed, sample_index, position))
        return gen

    def get(self, request_id: str, params: SamplingParams,
            sample_index: int) -> torch.Generator | None:
        """The request's generator as the step left it (None without a seed)."""
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

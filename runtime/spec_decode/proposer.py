"""The proposer a speculative config asks for."""
from __future__ import annotations

from typing import Union

import torch

from runtime.model_config import ModelConfig
from runtime.plugins.answers import PlatformAnswers
from runtime.sampling.generators import SeededGenerators
from runtime.config import EngineConfig
from runtime.config.speculative import SpeculativeConfig
from runtime.spec_decode.draft_model import DraftModelProposer, load_draft_proposer
from runtime.spec_decode.ngram import NgramProposer

Proposer = Union[NgramProposer, DraftModelProposer]


def build_proposer(config: SpeculativeConfig, target: ModelConfig, answers: PlatformAnswers,
                   generators: SeededGenerators, device: torch.device, block_size: int,
                   engine: EngineConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    return load_draft_proposer(config, target, answers, generators, device, block_size,
                               engine)

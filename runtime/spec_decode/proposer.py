"""The proposer a speculative config asks for."""
from __future__ import annotations

from typing import TYPE_CHECKING, Union

from runtime.config.speculative import SpeculativeConfig
from runtime.spec_decode.draft_model import DraftModelProposer, load_draft_proposer
from runtime.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from runtime.worker.worker import Worker

Proposer = Union[NgramProposer, DraftModelProposer]


def build_proposer(config: SpeculativeConfig, worker: "Worker") -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    return load_draft_proposer(worker, config)

"""The recurrent state cache of a hybrid model: per recurrent layer, its state tensors (a conv
state, an SSM or delta-rule state), one row per state slot, beside the paged KV cache.

The engine's KV-cache manager hands each running request a slot (`Request.state_slot`); the
step's metadata carries each request's slot (`state_indices`) and whether its slot holds the
state of tokens already computed (`has_initial_state`), as the block tables carry its blocks.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class StatefulLayer(nn.Module):
    """A layer that carries a fixed-size state from token to token.

    `state_shapes()` says what one slot holds (shape and dtype of each of its state tensors);
    the model runner binds `states`, each [num_slots, *shape], once the cache is allocated.
    """

    states: list[torch.Tensor]

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError


class RecurrentStateCache:
    """The state tensors of one model's recurrent layers, addressed by the engine's slots."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, StatefulLayer)]
        for layer in self.layers:
            layer.states = []

    @property
    def bytes_per_slot(self) -> int:
        return sum(torch.Size(shape).numel() * dtype.itemsize
                   for layer in self.layers for shape, dtype in layer.state_shapes())

    def allocate(self, num_slots: int, device: torch.device) -> None:
        """Slots are zeroed when a request starts in them (`zero_slots`), not here."""
        for layer in self.layers:
            layer.states = [torch.empty((num_slots, *shape), dtype=dtype, device=device)
                            for shape, dtype in layer.state_shapes()]

    def release(self) -> None:
        for layer in self.layers:
            layer.states = []

    def zero_slots(self, slots: Iterable[int]) -> None:
        """Clear the slots of requests starting from their first token: a decode op reads its
        slot whatever the metadata says, so it must hold no earlier request's state."""
        slots = list(slots)
        if not slots or not self.layers:
            return
        index = torch.tensor(slots, device=self.layers[0].states[0].device)
        for layer in self.layers:
            for state in layer.states:
                state.index_fill_(0, index, 0)

"""The recurrent state cache of a hybrid model: per recurrent layer, its state tensors (a conv
state, an SSM or delta-rule state), one row per state slot, beside the paged KV cache; and the
host store of their prefix-cache checkpoints, one entry per checkpointed block.

The engine's KV-cache manager hands each running request a slot (`Request.state_slot`); the
step's metadata carries each request's slot (`state_indices`) and whether its slot holds the
state of tokens already computed (`has_initial_state`), as the block tables carry its blocks.
It also names the rows after which a layer's state is checkpointed (`checkpoint_rows`) and the
store entries they go to (`checkpoint_ids`); a request resuming from a checkpoint has its slot
filled from the store before the step (`RecurrentStateCache.restore`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

HOST = torch.device("cpu")


class CheckpointBuffer:
    """Where a layer's prefill kernel writes the step's checkpoint states before `store` copies
    them into the host store: one buffer shared by every layer of the model and kept from step
    to step, grown when a step needs more. (A fresh [checkpoints, H, P, N] buffer per layer and
    step, 128 MiB for a 2048-token Mamba 2 prefill, faulted in its pages every time: about a
    quarter of that layer's scan time, 96 ms against 73 ms.) Layers run one after another,
    and `store` has copied the states out before the next layer takes the buffer."""

    def __init__(self) -> None:
        self.flat = torch.empty(0)

    def take(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 tensor of `shape` on `device`, its contents undefined."""
        numel = torch.Size(shape).numel()
        if self.flat.numel() < numel or self.flat.device != device:
            self.flat = torch.empty(numel, dtype=torch.float32, device=device)
        return self.flat[:numel].view(shape)


class StatefulLayer(nn.Module):
    """A layer that carries a fixed-size state from token to token.

    `state_shapes()` says what one slot holds (shape and dtype of each of its state tensors);
    the model runner binds `states`, each [num_slots, *shape], once the cache is allocated,
    `checkpoints`, each [num_entries, *shape] in host memory, and the model's shared
    `checkpoint_buffer`.
    """

    states: list[torch.Tensor]
    checkpoints: list[torch.Tensor]
    checkpoint_buffer: CheckpointBuffer

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def checkpoint_decodes(self, md) -> None:
        """After the decode ops ran: store the slots of the decodes that end a checkpointed
        block."""
        n = md.num_decode_checkpoints
        if n:
            slots = md.state_indices[md.checkpoint_rows[:n]]
            for state, store in zip(self.states, self.checkpoints):
                store[md.checkpoint_ids[:n]] = state[slots].to(HOST)

    def prefill_checkpoints(self, md) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(rows of the step's prefill part after which the state is checkpointed, their store
        entries), or (None, None)."""
        rows = md.checkpoint_rows
        n = md.num_decode_checkpoints
        if rows is None or n == rows.numel():
            return None, None
        return rows[n:] - md.num_decode_tokens, md.checkpoint_ids[n:]

    def checkpoint_states(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The buffer a prefill kernel fills with the layer's second state tensor (its SSM or
        delta-rule state) after each of `rows` (None: no checkpoints this step)."""
        if rows is None:
            return None
        state = self.states[1]
        return self.checkpoint_buffer.take((rows.numel(), *state.shape[1:]), state.device)

    def store(self, index: int, entries: torch.Tensor | None, states: torch.Tensor) -> None:
        """Write checkpoints of state tensor `index` into their store entries."""
        if entries is not None:
            self.checkpoints[index][entries] = states.to(HOST, self.checkpoints[index].dtype)


def conv_states_at(x: torch.Tensor, initial_state: torch.Tensor,
                   has_initial_state: torch.Tensor, query_start_loc: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """The causal conv's state [C, dim, width - 1] after each of `rows` of the varlen batch
    x [T, dim]: its last width - 1 inputs, oldest first; those before a sequence's first row
    come from its initial state [S, dim, width - 1] (zeros where has_initial_state is False)."""
    k = initial_state.size(-1)
    loc = query_start_loc.long()
    seq = torch.searchsorted(loc, rows, right=True) - 1
    idx = rows[:, None] + torch.arange(1 - k, 1, device=rows.device)  # [C, k]
    lo = loc[seq][:, None]
    from_x = x[idx.clamp(min=0)].transpose(1, 2)  # [C, dim, k]
    init = initial_state[seq] * has_initial_state[seq][:, None, None]
    where = (k + idx - lo).clamp(0, k - 1)[:, None, :].expand(-1, x.size(1), -1)
    return torch.where((idx >= lo)[:, None, :], from_x, init.gather(-1, where).to(x.dtype))


class RecurrentStateCache:
    """The state tensors of one model's recurrent layers, addressed by the engine's slots, and
    their checkpoint store, addressed by the engine's checkpoint entries."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, StatefulLayer)]
        self.buffer = CheckpointBuffer()
        for layer in self.layers:
            layer.states = []
            layer.checkpoints = []
            layer.checkpoint_buffer = self.buffer

    @property
    def bytes_per_slot(self) -> int:
        return sum(torch.Size(shape).numel() * dtype.itemsize
                   for layer in self.layers for shape, dtype in layer.state_shapes())

    def allocate(self, num_slots: int, device: torch.device, num_checkpoints: int = 0) -> None:
        """Zeroed here only to touch every page now: a host store of 1 GiB first written by
        the steps made a 2-core host's first prompts 5 % slower (its page faults inside the
        checkpoint copies). A slot is zeroed again when a request starts in it
        (`zero_slots`); store entries are written before they are read."""
        for layer in self.layers:
            layer.states = [torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                            for shape, dtype in layer.state_shapes()]
            layer.checkpoints = [torch.zeros((num_checkpoints, *shape), dtype=dtype,
                                             device=HOST)
                                 for shape, dtype in layer.state_shapes()]

    def release(self) -> None:
        self.buffer.flat = torch.empty(0)
        for layer in self.layers:
            layer.states = []
            layer.checkpoints = []

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

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """Fill slots from checkpoints: (slot, store entry) for each request resuming from
        a cached prefix."""
        if not pairs or not self.layers:
            return
        slots = torch.tensor([s for s, _ in pairs], device=self.layers[0].states[0].device)
        entries = torch.tensor([e for _, e in pairs])
        for layer in self.layers:
            for state, store in zip(layer.states, layer.checkpoints):
                state[slots] = store[entries].to(state.device)

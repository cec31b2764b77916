"""A worker's adapters: `max_loras` device slots, and an LRU of adapters read into host memory
(`max_cpu_loras`). Each step it puts the step's adapters in slots (evicting the least recently
used slot the step does not need) and tells the LoRA layers each token's slot."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from runtime.layers.linear import LinearBase
from runtime.lora.adapter import TARGETS, LoRAAdapter, load_adapter
from runtime.lora.layers import LoRALinear, StepLoRA
from runtime.lora.request import LoRARequest
from runtime.plugins.lora_ops import LoRABatch, lora_expand, lora_shrink

_LAYER_NAMES = {layer for layer, _ in TARGETS.values()}


class LoRAManager:
    def __init__(self, model: nn.Module, hf_config: Any, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, custom_op: Callable[[str], Callable | None],
                 device: torch.device) -> None:
        self.hf_config = hf_config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.step = StepLoRA()
        shrink = custom_op("lora_shrink") or lora_shrink
        expand = custom_op("lora_expand") or lora_expand
        self.layers: dict[str, LoRALinear] = {}
        for name, module in list(model.named_modules()):
            if name.rpartition(".")[2] in _LAYER_NAMES and isinstance(module, LinearBase):
                wrapped = LoRALinear(module, max_loras, max_lora_rank, self.step, shrink, expand)
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, wrapped)
                self.layers[name] = wrapped
        self.dtype = next(iter(self.layers.values())).a.dtype
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # adapter id -> weights, LRU first

    def prepare(self, lora_requests: Sequence[LoRARequest | None],
                query_lens: np.ndarray) -> None:
        """Slots for the step's adapters (one entry per request, in batch order), and each
        token's slot for the LoRA layers."""
        wanted = {r.lora_int_id: r for r in lora_requests if r is not None}
        if not wanted:
            self.step.batch = None
            return
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, max_loras is "
                               f"{self.max_loras} (the scheduler must not form it)")
        for request in wanted.values():
            self._activate(request, set(wanted))
        per_request = np.array([-1 if r is None else self.slots[r.lora_int_id]
                                for r in lora_requests], dtype=np.int64)
        token_slots = torch.from_numpy(np.repeat(per_request, query_lens)).to(self.device)
        groups = [(slot, (token_slots == slot).nonzero().squeeze(1))
                  for slot in sorted(set(per_request.tolist()) - {-1})]
        self.step.batch = LoRABatch(token_slots, groups)

    def _activate(self, request: LoRARequest, needed: set[int]) -> None:
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return
        used = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slots if i not in needed)
            slot = self.slots.pop(victim)
        adapter = self._host_copy(request)
        by_layer: dict[str, dict] = {}
        for (layer, index), weights in adapter.weights.items():
            by_layer.setdefault(layer, {})[index] = weights
        for name, layer in self.layers.items():
            layer.set_slot(slot, by_layer.get(name, {}))
        self.slots[lora_id] = slot

    def _host_copy(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.hf_config, self.max_lora_rank, self.dtype)
            self.cpu[request.lora_int_id] = adapter
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (unloaded by the server): its slot and host copy."""
        self.slots.pop(lora_id, None)
        self.cpu.pop(lora_id, None)

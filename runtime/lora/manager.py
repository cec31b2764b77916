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
        # the adapters are held in the model's dtype (its norms': its linear layers may be
        # quantized); the ops sum their products in float32
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.layers: dict[str, LoRALinear] = {}
        for name, module in list(model.named_modules()):
            if name.rpartition(".")[2] in _LAYER_NAMES and isinstance(module, LinearBase):
                wrapped = LoRALinear(module, max_loras, max_lora_rank, self.step, shrink, expand,
                                     self.dtype)
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, wrapped)
                self.layers[name] = wrapped
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # adapter id -> weights, LRU first
        self.failed: dict[int, str] = {}  # the step's adapters that could not be read -> why

    def before_forward(self, reqs: Sequence[Any], batch: Any) -> None:
        """A step hook (`runtime.worker.step_hooks`): `reqs` are the step's ScheduledRequests,
        `batch` its `runtime.batch.Batch`."""
        self.prepare([r.lora_request for r in reqs], batch.query_lens)

    def after_sampling(self, reqs: Sequence[Any], out: Any) -> None:
        self.fail_requests(reqs, out)

    def finish(self, request_ids: list[str]) -> None:
        pass  # adapters outlive requests

    def prepare(self, lora_requests: Sequence[LoRARequest | None],
                query_lens: np.ndarray) -> None:
        """Slots for the step's adapters (one entry per request, in batch order), and each
        token's slot for the LoRA layers. An adapter that cannot be read now (its folder gone
        or corrupt since it was checked) runs its tokens on the base model, and
        `fail_requests` ends its requests; the others run on."""
        wanted = {r.lora_int_id: r for r in lora_requests if r is not None}
        self.failed = failed = {}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, max_loras is "
                               f"{self.max_loras} (the scheduler must not form it)")
        for request in wanted.values():
            try:
                self._activate(request, set(wanted))
            except ValueError as e:
                failed[request.lora_int_id] = str(e)
        per_request = np.array([self.slots[r.lora_int_id] if r is not None and
                                r.lora_int_id not in failed else -1 for r in lora_requests],
                               dtype=np.int64)
        if (per_request < 0).all():
            self.step.batch = None
            return
        token_slots = torch.from_numpy(np.repeat(per_request, query_lens)).to(self.device)
        self.step.batch = LoRABatch.build(token_slots)

    def fail_requests(self, reqs: Sequence[Any], out: Any) -> None:
        """Mark the step's requests (the runner's ScheduledRequests, its StepOutput) whose
        adapter could not be read as failed (the engine ends them with the error), dropping
        what the base model computed for them."""
        for r in reqs:
            if r.lora_request is not None and r.lora_request.lora_int_id in self.failed:
                out.failed[r.request_id] = self.failed[r.lora_request.lora_int_id]
                for results in (out.sampled, out.logprobs, out.prompt_logprobs,
                                out.draft_token_ids):
                    results.pop(r.request_id, None)

    def _activate(self, request: LoRARequest, needed: set[int]) -> None:
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return
        adapter = self._host_copy(request)
        used = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slots if i not in needed)
            slot = self.slots.pop(victim)
        by_layer: dict[str, dict] = {}
        for (layer, index), weights in adapter.weights.items():
            by_layer.setdefault(layer, {})[index] = weights
        for name, layer in self.layers.items():
            layer.set_slot(slot, by_layer.get(name, {}))
        self.slots[lora_id] = slot

    def _host_copy(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.hf_config, self.max_lora_rank, self.dtype,
                                   self.layers)
            self.cpu[request.lora_int_id] = adapter
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (unloaded by the server): its slot and host copy."""
        self.slots.pop(lora_id, None)
        self.cpu.pop(lora_id, None)

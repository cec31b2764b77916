"""The KV connector's per-layer hooks: a connector that overrides them is called in every
attention layer, load wait before the layer reads its cache and save once it wrote the step's
K and V, then `wait_for_save` after the forward; a connector that does not is never called."""
from __future__ import annotations

import torch

from runtime import LLM, SamplingParams
from runtime.kv_transfer.offload.scheduler import OffloadScheduler
from runtime.kv_transfer.offload.worker import OffloadWorker
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.kv_connector import KVConnectorClasses
from runtime.plugins.manager import get_plugin_manager, reset_plugin_manager

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks and half of a fifth
CALLS: list[str] = []


class LayerMirror(OffloadWorker):
    """Copies each block a layer wrote this step into a host mirror, from `save_kv_layer`: the
    mirror equals the device cache only if every save came after that layer's write."""

    def register_kv_caches(self, layers):
        super().register_kv_caches(layers)
        self.mirror: dict[tuple[str, int], torch.Tensor] = {}

    def start_load_kv(self, meta):
        CALLS.append("start_load_kv")
        super().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name):
        CALLS.append(f"wait {layer_name}")

    def save_kv_layer(self, layer_name, metadata):
        CALLS.append(f"save {layer_name}")
        layer = next(layer for layer in self.layers if layer.name == layer_name)
        for block in (metadata.slot_mapping // BLOCK).unique().tolist():
            self.mirror[layer_name, block] = layer.tensor.select(layer.block_dim, block).clone()

    def wait_for_save(self):
        CALLS.append("wait_for_save")

    def get_finished(self):
        CALLS.append("get_finished")
        return super().get_finished()


class MirrorPlugin:
    @hookimpl
    def runtime_register_kv_connectors(self):
        return {"LayerMirror": KVConnectorClasses(OffloadScheduler, LayerMirror)}


def engine(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", block_size=BLOCK, max_model_len=64,
               kv_cache_memory=40 * 2048, **kwargs)


def test_layer_hooks_run_around_each_layers_write(tiny_llama):
    expected = engine(tiny_llama).generate([PROMPT], GREEDY, use_tqdm=False)
    reset_plugin_manager()
    get_plugin_manager().register(MirrorPlugin(), name="mirror")
    try:
        llm = engine(tiny_llama, kv_transfer_config={"kv_connector": "LayerMirror"})
        CALLS.clear()
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    finally:
        reset_plugin_manager()
    assert out[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    worker = llm.engine.core.executor.worker.kv_connector
    assert worker.uses_layer_hooks
    step = ["start_load_kv", "wait layer.0", "save layer.0", "wait layer.1", "save layer.1",
            "wait_for_save", "get_finished"]
    assert CALLS[:len(step)] == step
    assert CALLS.count("wait_for_save") == CALLS.count("get_finished") == GREEDY.max_tokens
    blocks = {block for _, block in worker.mirror}
    assert len(blocks) == 6  # 18 prompt + 4 generated tokens with a KV: 22 tokens, 6 blocks
    for layer in worker.layers:
        for block in blocks:
            assert torch.equal(worker.mirror[layer.name, block],
                               layer.tensor.select(layer.block_dim, block)), (layer.name, block)


def test_a_connector_without_layer_hooks_is_not_called_in_the_layers(tiny_llama, tmp_path):
    llm = engine(tiny_llama, kv_offloading_size=30 * 2048 / 2**30)
    worker = llm.engine.core.executor.worker
    assert not worker.kv_connector.uses_layer_hooks
    assert worker.runner.layer_connector is None

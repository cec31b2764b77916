"""The OffloadingConnector: blocks evicted from a small prefix cache go to host slots, then to
disk; hits load them back with the tokens of a recompute; a restarted engine finds the disk
level; corrupt or truncated files are recomputed; an abort after a load frees everything."""
from __future__ import annotations

import os
import random

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.engine.core_proc import CoreStats
from runtime.kv_transfer.offload.scheduler import OffloadScheduler
from runtime.kv_transfer.offload.worker import OffloadWorker
from runtime.metrics import Metrics
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.kv_connector import KVCacheLayer, KVConnectorClasses, KVConnectorContext
from runtime.plugins.manager import get_plugin_manager, reset_plugin_manager

BLOCK = 4
BYTES_PER_BLOCK = 2048  # the tiny Llama: 2 layers x K, V x 4 tokens x 2 heads x 16 x fp32
random.seed(0)
PROMPTS = [[random.randrange(3, 30000) for _ in range(64)] for _ in range(10)]
# the last prompts are still on the device, the ones before in host slots, the first on disk
AGAIN = [PROMPTS[7], PROMPTS[0], PROMPTS[1]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine(model: str, tp: int = 1, **kwargs) -> LLM:
    # 40 blocks on the device (each rank holds 1 / tp of a block): about two requests' worth
    return LLM(model, dtype="float32", block_size=BLOCK, max_model_len=128,
               kv_cache_memory=40 * BYTES_PER_BLOCK // tp, tensor_parallel_size=tp, **kwargs)


def one_by_one(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def offloading(model: str, disk: str, host_blocks: int = 30) -> LLM:
    return engine(model, kv_offloading_size=host_blocks * BYTES_PER_BLOCK / 2**30,
                  kv_offloading_disk_path=disk)


@pytest.fixture(scope="module")
def recomputed(tiny_llama):
    return one_by_one(engine(tiny_llama), PROMPTS + AGAIN)


def test_hits_from_host_and_disk_give_the_recomputed_tokens(tiny_llama, tmp_path, recomputed):
    llm = offloading(tiny_llama, str(tmp_path))
    assert one_by_one(llm, PROMPTS + AGAIN) == recomputed
    stats = llm.engine.core.kv_connector.stats()
    assert stats["host_hit_blocks"] > 0 and stats["disk_hit_blocks"] > 0, stats
    assert stats["spilled_blocks"] > 0 and stats["host_blocks"] == 30, stats
    assert stats["failed_loads"] == 0 and stats["bytes_loaded"] > 0
    metrics = Metrics("tiny")
    metrics.on_core_stats(CoreStats(kv_connector=stats))
    page = metrics.render().decode()
    for tier in ("host", "disk"):
        assert f'runtime:kv_offload_hit_blocks_total{{model_name="tiny",tier="{tier}"}} ' \
               f'{float(stats[tier + "_hit_blocks"])}' in page
    assert f'runtime:kv_offload_bytes_total{{direction="load",model_name="tiny"}} ' \
           f'{float(stats["bytes_loaded"])}' in page

    # a new engine on the same folder: the first prompts hit from disk at once
    del llm
    restarted = offloading(tiny_llama, str(tmp_path))
    assert one_by_one(restarted, PROMPTS[:3]) == recomputed[:3]
    stats = restarted.engine.core.kv_connector.stats()
    assert stats["disk_hit_blocks"] >= 3 * 15, stats  # 63 of each 64-token prompt are cached
    assert restarted.engine.core.kv.num_cache_hits == 0  # the device cache was empty


def test_corrupt_or_truncated_files_are_recomputed(tiny_llama, tmp_path, recomputed):
    one_by_one(offloading(tiny_llama, str(tmp_path)), PROMPTS)
    (folder,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    files = sorted(os.listdir(folder))
    for i, name in enumerate(files):
        path = os.path.join(folder, name)
        data = bytearray(open(path, "rb").read())
        if i % 3 == 0:  # one flipped bit in the payload
            data[-5] ^= 1
        elif i % 3 == 1:  # cut short
            data = data[:len(data) // 2]
        else:
            continue
        open(path, "wb").write(bytes(data))
    llm = offloading(tiny_llama, str(tmp_path))
    assert one_by_one(llm, PROMPTS[:3]) == recomputed[:3]
    stats = llm.engine.core.kv_connector.stats()
    assert stats["failed_loads"] > 0 and stats["disk_hit_blocks"] > 0, stats


def test_an_abort_after_a_load_frees_everything(tiny_llama, tmp_path):
    llm = offloading(tiny_llama, str(tmp_path))
    one_by_one(llm, PROMPTS[:4])
    core = llm.engine.core
    request_id = llm.engine.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    llm.engine.step()  # admits it and loads its blocks, computing nothing
    (loading,) = core.scheduler.running
    assert loading.num_computed_tokens == 60 and not loading.output_token_ids
    llm.engine.abort_request(request_id)
    assert not core.scheduler.has_unfinished()
    assert core.kv.num_free_blocks == core.num_blocks


def _worker_and_cache(tmp_path, num_blocks: int, slots: int):
    context = KVConnectorContext("kv_both", BLOCK, "ns", {
        "host_bytes": slots * 64, "disk_path": str(tmp_path), "disk_bytes": 2 * 64},
        bytes_per_block=64)
    cache = torch.zeros(num_blocks, 16)  # one layer, 16 fp32 per block
    worker = OffloadWorker(context)
    worker.register_kv_caches([KVCacheLayer("layer.0", cache, 0)])
    return OffloadScheduler(context, num_blocks), worker, cache


class Wanting:
    """A request as the scheduler side sees it."""

    def __init__(self, request_id: str, block_hashes: list[bytes]) -> None:
        self.request_id, self.block_hashes = request_id, block_hashes
        self.num_tokens = self.num_prompt_tokens = BLOCK * len(block_hashes) + 1


def test_orders_run_in_sequence_so_a_step_never_reads_what_is_not_written(tmp_path):
    scheduler, worker, cache = _worker_and_cache(tmp_path, num_blocks=4, slots=2)
    for block_id in range(3):
        cache[block_id] = float(block_id + 1)
    # three evictions into two host slots: A's slot is spilled to disk before C reuses it
    for block_id, name in enumerate((b"A", b"B", b"C")):
        scheduler.on_evict(block_id, name)
    # in the same step, a request wants A (now on disk) and C (in A's old slot) in block 3, 0
    wanting = Wanting("r", [b"A", b"C"])
    assert scheduler.get_num_new_matched_tokens(wanting, 0) == 2 * BLOCK
    scheduler.update_state_after_alloc(wanting, [3, 0], 0, 2)
    orders = scheduler.build_connector_meta()
    assert [o[0] for o in orders] == ["save", "save", "spill", "save", "load_disk", "load_host"]
    worker.start_load_kv(orders)
    assert cache[3].eq(1).all() and cache[0].eq(3).all()  # A's and C's contents
    assert not worker.get_finished().failed_loads
    # the disk level holds 2 blocks: a third drops the least recently used file
    scheduler.on_evict(1, b"D")
    scheduler.on_evict(2, b"E")
    worker.start_load_kv(scheduler.build_connector_meta())
    assert sorted(os.listdir(os.path.join(tmp_path, "ns"))) == \
        sorted(f"{h.hex()}.r0" for h in scheduler.disk)


CALLS: list[str] = []


class RecordingScheduler(OffloadScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        CALLS.append("get_num_new_matched_tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, first_block, num_blocks):
        CALLS.append("update_state_after_alloc")
        super().update_state_after_alloc(request, block_ids, first_block, num_blocks)

    def update_connector_output(self, output):
        CALLS.append("update_connector_output")
        super().update_connector_output(output)


class RecordingWorker(OffloadWorker):
    def start_load_kv(self, meta):
        CALLS.append("start_load_kv " + ",".join(o[0] for o in meta))
        super().start_load_kv(meta)


class ConnectorPlugin:
    @hookimpl
    def runtime_register_kv_connectors(self):
        return {"Recording": KVConnectorClasses(RecordingScheduler, RecordingWorker)}


def test_a_plugin_connector_is_named_by_kv_transfer_config(tiny_llama, recomputed):
    reset_plugin_manager()
    get_plugin_manager().register(ConnectorPlugin(), name="recording")
    try:
        with pytest.raises(ValueError, match="unknown kv_connector 'Nope'; known: "
                                             "OffloadingConnector, P2pTcpConnector, "
                                             "Recording, SharedStorageConnector"):
            engine(tiny_llama, kv_transfer_config={"kv_connector": "Nope"})
        llm = engine(tiny_llama, kv_transfer_config={
            "kv_connector": "Recording",
            "kv_connector_extra_config": {"host_bytes": 64 * BYTES_PER_BLOCK}})
        CALLS.clear()
        assert one_by_one(llm, PROMPTS[:4] + PROMPTS[:1]) == recomputed[:4] + recomputed[:1]
    finally:
        reset_plugin_manager()
    loads = [i for i, c in enumerate(CALLS) if c.startswith("start_load_kv") and "load_host" in c]
    assert loads, CALLS
    first = loads[0]  # the step that loads prompt 0 back: asked, allocated, loaded, reported
    assert CALLS[first - 2:first + 2] == [
        "get_num_new_matched_tokens", "update_state_after_alloc", CALLS[first],
        "update_connector_output"], CALLS[first - 3:first + 3]


def test_tensor_parallel_ranks_keep_their_own_files(tiny_llama, tmp_path, recomputed):
    """Each rank saves its share of a block; a corrupt file on rank 1 alone fails the load
    (the executor merges every rank's report) and the block is computed again."""
    def tp2() -> LLM:  # no host level: every evicted block goes to disk
        return engine(tiny_llama, tp=2, kv_offloading_disk_path=str(tmp_path))
    llm = tp2()
    assert one_by_one(llm, PROMPTS[:4]) == recomputed[:4]
    llm.engine.core.shutdown()
    (folder,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    names = os.listdir(folder)
    assert {n.rsplit(".", 1)[1] for n in names} == {"r0", "r1"}
    for name in names:
        if name.endswith(".r1"):
            path = os.path.join(folder, name)
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 1
            open(path, "wb").write(bytes(data))
    restarted = tp2()
    assert one_by_one(restarted, PROMPTS[:1]) == recomputed[:1]
    stats = restarted.engine.core.kv_connector.stats()
    assert stats["disk_hit_blocks"] > 0 and stats["failed_loads"] == 1, stats
    restarted.engine.core.shutdown()


def test_sleep_starts_the_host_level_anew(tiny_llama, tmp_path, recomputed):
    llm = engine(tiny_llama, enable_sleep_mode=True,
                 kv_offloading_size=30 * BYTES_PER_BLOCK / 2**30)
    assert one_by_one(llm, PROMPTS[:4]) == recomputed[:4]
    assert llm.engine.core.kv_connector.stats()["host_blocks"] > 0
    llm.sleep(1)
    llm.wake_up()
    assert llm.engine.core.kv_connector.stats()["host_blocks"] == 0
    assert one_by_one(llm, PROMPTS[:2]) == recomputed[:2]


def test_a_stopped_engine_leaves_its_prefix_cache_on_disk(tiny_llama, tmp_path, recomputed):
    llm = offloading(tiny_llama, str(tmp_path))
    assert one_by_one(llm, PROMPTS[:1]) == recomputed[:1]  # nothing evicted: all on the device
    assert llm.engine.core.kv_connector.stats()["saved_blocks"] == 0
    llm.engine.core.shutdown()
    restarted = offloading(tiny_llama, str(tmp_path))
    assert one_by_one(restarted, PROMPTS[:1]) == recomputed[:1]
    assert restarted.engine.core.kv_connector.stats()["disk_hit_blocks"] == 15

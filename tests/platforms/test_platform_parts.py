"""The accelerator platforms' host-side parts: device binding, memory budgets, graph sizes,
padding, collectives, FlashInfer's plans and the Triton kernel under AMD's dot precisions."""
import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist

from runtime.attention_backends import flashinfer
from runtime.attention_backends.flashinfer import FlashInferBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.config import EngineConfig
from runtime.platforms.cuda.graph_runner import capture_sizes, replay_size
from runtime.platforms.cuda.platform import GiB, CudaPlatform, GpuDevice, kv_cache_budget
from runtime.platforms.distributed import TorchDistCommunicator
from runtime.platforms.tpu.graph_runner import bucket, buckets, pad_metadata
from runtime.platforms.tpu.platform import memory_info
from runtime.platforms.xpu.platform import collective_backend
from runtime.plugins.interfaces import CommunicatorSpec
from runtime.plugins.manager import reset_plugin_manager
from runtime.plugins.selection import select_platform
from runtime.testing.paged_batch import make_batch, run_backend
from runtime.worker.worker import Worker, start_worker
from tests.platforms.fakes import (H100 as H100_PROPS, MAX1550, FakeDeviceState,
                                   fake_flashinfer, fake_gpus, fake_libraries, fake_xpus)

H100 = GpuDevice(0, "H100", (9, 0), 80 * GiB)


def test_kv_budget_from_free_memory():
    # 80 GiB card, 0.9 usable = 72 GiB; 16 GiB model (weights + activation peak); the CUDA
    # context and another process hold 3 GiB outside torch's allocator (62 used, 59 by torch).
    budget = kv_cache_budget(None, free=18 * GiB, total=80 * GiB, reserved=59 * GiB,
                             model_bytes=16 * GiB, utilization=0.9, device_name="H100")
    assert budget == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB
    assert kv_cache_budget(GiB, 18 * GiB, 80 * GiB, 0, 0, 0.9, "H100") == GiB
    with pytest.raises(ValueError, match="asks for 20.00 GiB but H100 has 18.00 GiB free"):
        kv_cache_budget(20 * GiB, 18 * GiB, 80 * GiB, 0, 0, 0.9, "H100")
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        kv_cache_budget(None, 4 * GiB, 80 * GiB, 70 * GiB, 70 * GiB, 0.9, "H100")


def test_platform_reads_the_device(monkeypatch):
    """The platform's own call path, with torch.cuda's memory answers faked."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (40 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 38 * GiB)
    platform = CudaPlatform([H100])
    platform.set_memory_utilization(0.5)
    assert platform.kv_cache_memory_bytes(None, 10 * GiB) == 40 * GiB - 10 * GiB - 2 * GiB
    with pytest.raises(ValueError, match="must be in"):
        platform.set_memory_utilization(1.5)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(10_000)[-1] == 512


def test_replay_only_decode_batches_that_fit():
    sizes = [1, 2, 4, 8]
    decodes = make_batch([1, 1, 1], [5, 9, 3], 4, 2, 1, 16)[4]
    assert replay_size(sizes, 3, decodes) == 4
    mixed = make_batch([1, 4], [5, 9], 4, 2, 1, 16)[4]
    assert replay_size(sizes, 5, mixed) is None
    many = make_batch([1] * 9, [3] * 9, 4, 2, 1, 16)[4]
    assert replay_size(sizes, 9, many) is None


def test_tpu_buckets_and_padding():
    assert buckets(16, 100) == [16, 32, 64, 100] and bucket([16, 32, 64, 100], 33) == 64
    md = make_batch([1, 3], [4, 7], 4, 2, 1, 16)[4]
    padded = pad_metadata(md, num_tokens=16, num_reqs=4, max_query_len=4, table_width=5,
                          max_seq_len=64)
    assert padded.slot_mapping.tolist()[4:] == [-1] * 12
    assert padded.query_start_loc.tolist() == [0, 1, 4, 4, 4]
    assert padded.seq_lens.tolist() == [4, 7, 0, 0]
    assert padded.block_tables.shape == (4, 5) and padded.num_reqs == 4
    assert memory_info({"bytes_used": 1, "bytes_limit": 8}) == (1, 8)
    assert memory_info({"kb_free": 6, "kb_total": 8}) == (2048, 8192)


def test_xpu_collectives_backend(monkeypatch):
    monkeypatch.setattr(dist, "is_xccl_available", lambda: True, raising=False)
    assert collective_backend() == "xccl"
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False, raising=False)
    fake_libraries(monkeypatch, missing=("oneccl_bindings_for_pytorch",))
    with pytest.raises(RuntimeError, match="no XPU collectives"):
        collective_backend()


def test_torch_dist_communicator_on_gloo():
    """The shared communicator class, over gloo on a world of one (NCCL needs a GPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    comm = TorchDistCommunicator(CommunicatorSpec([0], 0, f"tcp://127.0.0.1:{port}"), "gloo",
                                 torch.device("cpu"))
    try:
        x = torch.arange(6.0).view(2, 3).t()  # not contiguous
        assert torch.equal(comm.all_reduce(x), torch.arange(6.0).view(2, 3).t())
        assert comm.all_gather(torch.ones(2, 1), dim=-1).shape == (2, 1)
        assert comm.broadcast_object({"a": 1}) == {"a": 1}
        assert (comm.rank, comm.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fresh_plugins():
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def test_every_rank_binds_its_own_gpu(monkeypatch, fresh_plugins):
    """Four ranks on a 4-GPU machine, each started as the mp executor starts it: every rank
    makes its GPU current before anything touches a device, so its memory query (like its
    kernels, graphs and NCCL communicator) goes to its own GPU, not GPU 0."""
    fake_gpus(monkeypatch, [H100_PROPS] * 4)
    state = FakeDeviceState(monkeypatch)
    # Model loading is left out; what it does first on a GPU is ask the device for memory.
    monkeypatch.setattr(Worker, "load_model",
                        lambda self: self.platform.kv_cache_memory_bytes(None, 0))
    config = EngineConfig(tensor_parallel_size=4)
    for rank in range(4):
        worker = start_worker(config, "cuda", None, None, rank, rank, rank, 4,
                              "tcp://127.0.0.1:1")
        assert worker.device == torch.device("cuda", rank)
    assert state.calls == [(call, rank) for rank in range(4)
                           for call in ("set_device", "mem_get_info")]


def test_xpu_ranks_bind_through_torch_xpu(monkeypatch, fresh_plugins):
    fake_xpus(monkeypatch, [MAX1550, MAX1550])
    state = FakeDeviceState(monkeypatch, module=torch.xpu)
    xpu = select_platform("xpu")
    assert Worker(EngineConfig(), xpu, None, None, 1, 1).device == torch.device("xpu", 1)
    assert state.calls == [("set_device", 1)]


@pytest.fixture
def flashinfer_plans(monkeypatch):
    monkeypatch.setattr(flashinfer, "_PLANS", {})
    monkeypatch.setattr(flashinfer, "_WORKSPACES", {})
    return fake_flashinfer(monkeypatch)


def test_flashinfer_plans_per_layer_kind(flashinfer_plans):
    """A model mixing global and sliding-window layers with their own scales (Gemma 2/3): each
    layer attends with its own window and scale, one plan per kind of layer and step."""
    batch = make_batch([1, 1, 6, 9], [5, 21, 6, 30], 4, 4, 2, 64)
    query, key, value, kv_cache, metadata = batch
    layers = [(None, 0.125), (5, 0.2), (None, 0.125), (5, 0.2)]  # (window, scale)
    for window, scale in layers:
        args = (4, 64, scale, 2, window)
        got = FlashInferBackend(*args).forward(query, key, value, kv_cache.clone(), metadata)
        want = TorchPagedAttention(*args).forward(query, key, value, kv_cache.clone(), metadata)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the two decodes through the decode kernel, the two chunks through the prefill kernel
    assert [(p["kind"], p["window_left"], p["sm_scale"]) for p in flashinfer_plans] == [
        ("prefill", -1, 0.125), ("decode", -1, 0.125), ("prefill", 4, 0.2), ("decode", 4, 0.2)]
    assert [p["kv_indptr"] for p in flashinfer_plans[:2]] == [[0, 2, 10], [0, 2, 8]]
    next_step = dataclasses.replace(metadata)
    FlashInferBackend(4, 64, 0.125, 2).forward(query, key, value, kv_cache.clone(), next_step)
    assert len(flashinfer_plans) == 6  # a new step's metadata is planned again
    assert len(flashinfer._WORKSPACES) == 1  # the wrappers share one workspace


def test_flashinfer_soft_cap_is_part_of_the_plan(flashinfer_plans):
    batch = make_batch([1, 7], [9, 7], 4, 4, 2, 64)
    capped = FlashInferBackend(4, 64, 0.125, 2)
    capped.logits_soft_cap = 0.5
    plain_out, _ = run_backend(FlashInferBackend, batch)
    capped_out = capped.forward(*batch[:3], batch[3].clone(), batch[4])
    assert [p["logits_soft_cap"] for p in flashinfer_plans] == [None, None, 0.5, 0.5]
    assert not torch.allclose(plain_out, capped_out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter has no bf16
def test_triton_kernel_under_amds_dot_precisions(monkeypatch, dtype):
    """Triton's AMD backend allows "tf32" on gfx942 only; the kernel must build elsewhere too."""
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set")
    from triton.runtime import interpreter

    from runtime.attention_backends.triton_paged import TritonPagedAttention
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(
        builder.options, default_dot_input_precision="ieee",
        allowed_dot_input_precisions=("ieee", "bf16x3", "bf16x6")))
    batch = make_batch([1, 5], [9, 12], 4, 4, 2, 16, dtype)
    reference = make_batch([1, 5], [9, 12], 4, 4, 2, 16)
    got, _ = run_backend(TritonPagedAttention, batch)
    want, _ = run_backend(TorchPagedAttention, reference)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)

"""GlooCommunicator with real processes: the world group, then a sub-group of ranks 0 and 2."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.plugins.interfaces import CommunicatorSpec
from runtime.plugins.manager import get_plugin_manager
from runtime.platforms.cpu.platform import CpuInfo, CpuPlatform

WORLD = 3


def _worker(rank: int, init_method: str, results: dict) -> None:
    hook = get_plugin_manager().hook
    platform = CpuPlatform(CpuInfo("x86_64", "test", frozenset()))
    world = hook.runtime_communicator(
        platform=platform, spec=CommunicatorSpec(list(range(WORLD)), rank, init_method))
    out = {"rank": world.rank, "size": world.world_size}

    x = torch.full((2, 3), float(rank + 1))
    out["all_reduce"] = world.all_reduce(x).clone()
    out["all_reduce_same_object"] = out["all_reduce"].equal(x)
    out["all_reduce_bf16"] = world.all_reduce(torch.ones(4, dtype=torch.bfloat16) * (rank + 1))
    strided = torch.full((3, 4), float(rank)).t()  # non-contiguous view
    out["all_reduce_strided"] = world.all_reduce(strided).clone()
    out["all_gather"] = world.all_gather(torch.full((2, 1), float(rank)), dim=-1)
    out["all_gather_dim0"] = world.all_gather(torch.tensor([[rank]]), dim=0)
    out["broadcast"] = world.broadcast_object({"step": 7} if rank == 0 else None, src=0)

    if rank != 1:  # only members build a sub-group
        sub = hook.runtime_communicator(
            platform=platform, spec=CommunicatorSpec([2, 0], rank, init_method))
        out["sub"] = (sub.rank, sub.world_size)
        if sub.rank == 0:
            sub.send(torch.arange(5.0), dst=1)
            out["recv"] = sub.recv(torch.empty(2), src=1)
        else:
            out["recv"] = sub.recv(torch.empty(5), src=0)
            sub.send(torch.tensor([40.0, 2.0]), dst=0)
        out["sub_all_reduce"] = sub.all_reduce(torch.tensor([float(rank)]))
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = out


def test_gloo_collectives_across_processes(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(f"file://{tmp_path / 'store'}", results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = results[rank]
        assert (r["rank"], r["size"]) == (rank, WORLD)
        assert torch.equal(r["all_reduce"], torch.full((2, 3), 6.0))
        assert r["all_reduce_same_object"]
        assert torch.equal(r["all_reduce_bf16"], torch.full((4,), 6.0, dtype=torch.bfloat16))
        assert torch.equal(r["all_reduce_strided"], torch.full((4, 3), 3.0))
        assert torch.equal(r["all_gather"], torch.tensor([[0.0, 1.0, 2.0]] * 2))
        assert torch.equal(r["all_gather_dim0"], torch.tensor([[0], [1], [2]]))
        assert r["broadcast"] == {"step": 7}
    assert "sub" not in results[1]
    assert results[0]["sub"] == (0, 2) and results[2]["sub"] == (1, 2)
    assert torch.equal(results[2]["recv"], torch.arange(5.0))
    assert torch.equal(results[0]["recv"], torch.tensor([40.0, 2.0]))
    assert torch.equal(results[0]["sub_all_reduce"], torch.tensor([2.0]))

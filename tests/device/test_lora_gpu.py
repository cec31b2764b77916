"""Section 2 of tests/device/run.sh: the Triton LoRA kernels compiled for the GPU against the
torch reference on the host (the CPU tests run them through the interpreter), in float32 and
bf16, with tokens of several adapters and none in one batch, and inside a CUDA graph."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from runtime.platforms.cuda import lora_triton  # noqa: E402
from runtime.plugins.lora_ops import LoRABatch, lora_expand, lora_shrink  # noqa: E402
from tests.lora.test_lora_ops import random_case  # noqa: E402

SLOTS = [1, -1, 0, 1, 1, -1, 2, 0] * 5


def on_gpu(case):
    x, y, a, b, batch, offsets = case
    return (x.cuda(), y.cuda(), a.cuda(), b.cuda(), LoRABatch.build(batch.token_slots.cuda()),
            offsets)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=str)
@pytest.mark.parametrize("rank,sizes", [(8, [512, 128, 128]), (64, [1024])])
def test_kernels(dtype, tol, rank, sizes):
    case = random_case(0, 3, rank, 256, sizes, SLOTS, dtype)
    x, y, a, b, batch, offsets = case
    want_buf = lora_shrink(x.float(), a.float(), batch)
    want = lora_expand(y.float(), want_buf, b.float(), batch, offsets)
    gx, gy, ga, gb, gbatch, _ = on_gpu(case)
    buf = lora_triton.lora_shrink(gx, ga, gbatch)
    torch.testing.assert_close(buf.float().cpu(), want_buf, atol=tol * rank, rtol=tol)
    got = lora_triton.lora_expand(gy, buf, gb, gbatch, offsets)
    torch.testing.assert_close(got.float().cpu(), want, atol=tol * rank, rtol=tol)


def test_cuda_graph_records_the_kernels():
    x, y, a, b, batch, offsets = on_gpu(random_case(1, 3, 16, 256, [256, 64], SLOTS))

    def run() -> torch.Tensor:
        return lora_triton.lora_expand(y.clone(), lora_triton.lora_shrink(x, a, batch), b, batch,
                                       offsets)

    run()  # compile and copy the offsets outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, run())

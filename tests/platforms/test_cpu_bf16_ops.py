"""The CPU platform's bf16/fp16 paths against float32 references at half-precision tolerances:
the dense kernel's packed oneDNN weights (also with oneDNN held to older ISAs, which it picks at
run time) and the fused element-wise kernels on the row counts of prefill and decode steps."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from runtime.platforms.cpu import ops

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def check_dense(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias = (torch.randn(96, 40) * 0.2).to(dtype), torch.randn(96).to(dtype)
    dense = ops.linear(weight)
    x = torch.randn(rows, 40).to(dtype)
    for b in (bias, None):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        got = dense(x, b)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_dense_kernel_in_half_precision(dtype, rows):
    check_dense(dtype, rows)


def test_bf16_weights_are_packed_where_onednn_computes_bf16():
    packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (ops.onednn_rows(torch.bfloat16) is not None) == packs


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE"])
def test_dense_kernel_under_an_older_onednn_isa(isa):
    script = ("import torch; from tests.platforms.test_cpu_bf16_ops import check_dense\n"
              "for rows in (1, 64, 300): check_dense(torch.bfloat16, rows)\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr

#!/usr/bin/env bash
# The CUDA device tests: kernels compiled for the GPU, decode graphs recorded and replayed, every
# usable attention backend and the engine against the references, FP8 w8a8, NCCL, and a
# throughput figure.
# Run it on a machine with an NVIDIA GPU and the project installed (`pip install -e ".[cuda,test]"`);
# without a CUDA device it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "tests/device/run.sh: no CUDA device visible: device tests skipped"
    exit 0
fi
unset TRITON_INTERPRET  # compile the Triton kernels for the GPU
python3 -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"device: {p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__} (CUDA {torch.version.cuda})")'
python3 -m runtime.cli.main plugins
echo "== Triton kernels (compiled) against the portable backend, backends, graphs, engine"
python3 -m pytest -q -rs -p no:cacheprovider tests/platforms/test_triton_paged.py tests/device
echo "== FP8 w8a8 through torch._scaled_mm (sm89+; skipped below)"
python3 -m pytest -q -rs -p no:cacheprovider tests/quantization/test_fp8_cuda.py
echo "== conformance suite, cuda platform"
python3 -m runtime.testing.conformance --device cuda -q -rs -p no:cacheprovider
echo "== throughput"
python3 tests/device/bench_cuda.py

"""Bidirectional attention within an image (`AttentionMetadata.mm_prefix_ranges`, Gemma 3) in
the portable backend, against the float32 reference of the conformance suite's check: ranges
in a first-step prefill, a decode's context and a prefill chunk (one begun in the cached
context), with and without a sliding window."""
from __future__ import annotations

import pytest
import torch

from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.testing.attention_check import CASES, check_attention


@pytest.mark.parametrize("case", ["mm-prefix", "mm-prefix-sliding-window"])
def test_torch_paged_applies_the_ranges(case):
    check_attention(TorchPagedAttention, torch.float32, "cpu", CASES[case])


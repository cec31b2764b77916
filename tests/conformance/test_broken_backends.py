"""The conformance suite's attention check catches each kind of broken backend, with a message
that shows the mismatch: the example platform's backend (examples/acme_platform) passes it, and
fails it once broken on purpose, six ways."""
import sys
from pathlib import Path

import pytest
import torch

from runtime.testing.attention_check import CASES, check_attention

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "acme_platform"))
from runtime_acme.attention import AcmePagedAttention  # noqa: E402

sys.path.pop(0)


class HardCodedScale(AcmePagedAttention):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.scale = self.head_size ** -0.5


class NoSoftCap(AcmePagedAttention):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.logits_soft_cap = None


class NoWindow(AcmePagedAttention):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sliding_window = None


class WrongGqa(AcmePagedAttention):
    """KV heads stored (and so read) in reverse: query head h meets KV head n - 1 - h // g."""

    def forward(self, query, key, value, kv_cache, metadata):
        return super().forward(query, key.flip(1), value.flip(1), kv_cache, metadata)


class NoCacheWrite(AcmePagedAttention):
    """Writes into a copy of the cache, so the next step finds nothing there."""

    def forward(self, query, key, value, kv_cache, metadata):
        return super().forward(query, key, value, kv_cache.clone(), metadata)


class Bf16Only(AcmePagedAttention):
    """A bfloat16 code path that reads K where V belongs."""

    def forward(self, query, key, value, kv_cache, metadata):
        if query.dtype == torch.bfloat16:
            value = key
        return super().forward(query, key, value, kv_cache, metadata)


# broken backend -> (the dtype and case that show it, what the message must name)
CAUGHT = {
    HardCodedScale: (torch.float32, "scale", "scale 0.37"),
    Bf16Only: (torch.bfloat16, "scale", "bfloat16"),
    NoSoftCap: (torch.float32, "soft-cap", "logits_soft_cap 1.5"),
    NoWindow: (torch.float32, "sliding-window", "sliding_window 12"),
    WrongGqa: (torch.float32, "scale", "8 query heads over 2 KV heads"),
    NoCacheWrite: (torch.float32, "scale", "step 2 (decodes and prefill chunks reading"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_example_backend_passes(dtype, case):
    check_attention(AcmePagedAttention, dtype, "cpu", CASES[case])


@pytest.mark.parametrize("broken", list(CAUGHT), ids=lambda cls: cls.__name__)
def test_each_broken_backend_fails_with_the_mismatch(broken):
    dtype, case, named = CAUGHT[broken]
    with pytest.raises(AssertionError) as failure:
        check_attention(broken, dtype, "cpu", CASES[case], label=broken.__name__)
    message = str(failure.value)
    assert broken.__name__ in message and named in message, message
    assert " values outside atol = rtol = " in message and "got " in message \
        and "want " in message, message


def test_the_bf16_bug_needs_the_bf16_run():
    check_attention(Bf16Only, torch.float32, "cpu", CASES["scale"])

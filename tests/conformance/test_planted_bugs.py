"""The conformance suite fails each bug a vendor plants in a platform, with a message that names
the bug: the example platform (examples/acme_platform) with one bug at a time, in test-only
subclasses, run through the suite's own tests."""
import sys
from pathlib import Path

import pytest
import torch

from runtime.platforms.common import offer_backend
from runtime.testing.conformance import test_conformance as suite
from runtime.testing.conformance.conftest import suite_model_info

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "acme_platform"))
from runtime_acme.attention import AcmePagedAttention  # noqa: E402
from runtime_acme.platform import AcmePlatform  # noqa: E402

sys.path.pop(0)


def rms_norm_without_eps(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / x32.pow(2).mean(-1, keepdim=True).sqrt()).to(x.dtype)


class IgnoresEps(AcmePlatform):
    def custom_op(self, name):
        return rms_norm_without_eps if name == "rms_norm" else None


class Bf16Accumulation(AcmePagedAttention):
    """Scores, exponentials and sums in the input dtype, and exp without the max subtraction."""

    def softmax_attention(self, q, k, v, mask):
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        weights = scores.exp().masked_fill(~mask, 0)
        return torch.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdim=True), v)


class NoDecodeCacheWrite(AcmePagedAttention):
    def write_cache(self, key, value, kv_cache, metadata):
        n = metadata.num_decode_tokens
        kv_cache[0].flatten(0, 1)[metadata.slot_mapping[n:]] = key[n:]
        kv_cache[1].flatten(0, 1)[metadata.slot_mapping[n:]] = value[n:]


class DecodeOneFewer(AcmePagedAttention):
    def context(self, kv_cache, metadata, request):
        k, v = super().context(kv_cache, metadata, request)
        starts = metadata.query_start_loc_cpu
        decode = starts[request + 1] - starts[request] == 1
        return (k[:-1], v[:-1]) if decode else (k, v)


class ModuloGqa(AcmePagedAttention):
    def kv_head_of(self):
        return torch.arange(self.num_heads) % self.num_kv_heads


class DefaultScale(AcmePagedAttention):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.scale = self.head_size ** -0.5


class WindowOneTooWide(AcmePagedAttention):
    """Keeps k_pos >= q_pos - window: the query's own position and `window` before it."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sliding_window += 1


class NoSoftCap(AcmePagedAttention):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.logits_soft_cap = None


class NoSinks(AcmePagedAttention):
    """Declares attention sinks, then drops them."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sinks = None


class DocsDeviceType(AcmePlatform):
    """Copies the docs' old example: the platform's name where torch's device type belongs."""

    def attention_backend_candidates(self, model):
        return [offer_backend("acme_paged", AcmePagedAttention, 10, model, "acme", "acme", [])]


def with_backend(backend: type) -> AcmePlatform:
    return type(f"AcmeWith{backend.__name__}", (AcmePlatform,), {"attention_backend": backend})()


def attention(dtype: str, case: str):
    return lambda platform: suite.test_attention_matches_the_reference(
        platform, suite_model_info(torch.float32), dtype, case)


# the planted bug -> the platform carrying it, the suite's test that must fail, what its
# message must say
PLANTED = {
    "rms_norm ignores eps": (IgnoresEps(), lambda p: suite.test_custom_op_matches_the_portable_one(
        p, "rms_norm", "float32"), "the op ignores eps"),
    "add_rms_norm composed from that rms_norm": (
        IgnoresEps(), lambda p: suite.test_custom_op_matches_the_portable_one(
            p, "add_rms_norm", "bfloat16"), "composed from rms_norm (acme platform)"),
    "bf16 attention accumulated in bf16 without the max subtraction": (
        with_backend(Bf16Accumulation), attention("bfloat16", "soft-cap"),
        "the arithmetic loses precision"),
    "cache never written on decode": (
        with_backend(NoDecodeCacheWrite), attention("float32", "scale"),
        "the KV cache was not written for decode rows in step 2"),
    "decode attends to one position fewer": (
        with_backend(DecodeOneFewer), attention("float32", "scale"),
        "decode rows attend to seq_len − 1 positions"),
    "a GQA mapping by modulo": (
        with_backend(ModuloGqa), attention("float32", "scale"),
        "read KV heads [0, 1, 0, 1, 0, 1, 0, 1] (h % num_kv_heads, a modulo mapping)"),
    "the default scale": (
        with_backend(DefaultScale), attention("float32", "scale"),
        "use the default scale head_size ** -0.5 = 0.125, not the layer's scale 0.37"),
    "a sliding window one too wide": (
        with_backend(WindowOneTooWide), attention("float32", "sliding-window"),
        "keep 13 positions in the sliding window, one too many"),
    "no soft-cap": (with_backend(NoSoftCap), attention("float32", "soft-cap"),
                    "apply no logit soft-cap"),
    "no attention sinks": (with_backend(NoSinks), attention("float32", "sinks"),
                           "no attention sinks applied"),
    "no attention sinks beside a sliding window": (
        with_backend(NoSinks), attention("bfloat16", "sinks-sliding-window"),
        "no attention sinks applied"),
    "the docs' device type in offer_backend": (
        DocsDeviceType(), lambda p: suite.test_backend_candidates_explain_the_choice(
            p, suite_model_info(torch.float32)), "device_type 'acme' is not a torch device type"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_the_suite_names_each_planted_bug(bug):
    platform, run, named = PLANTED[bug]
    with pytest.raises((AssertionError, ValueError)) as failure:
        run(platform)
    assert named in str(failure.value), str(failure.value)


@pytest.mark.parametrize("bug", ["cache never written on decode",
                                 "decode attends to one position fewer"])
def test_the_two_decode_bugs_read_differently(bug):
    """They once printed the same line; each names its own cause, and not the other's."""
    platform, run, _ = PLANTED[bug]
    with pytest.raises(AssertionError) as failure:
        run(platform)
    other = next(n for b, (_, _, n) in PLANTED.items()
                 if b != bug and b in ("cache never written on decode",
                                       "decode attends to one position fewer"))
    assert other not in str(failure.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["scale", "sliding-window", "soft-cap", "sinks",
                                  "sinks-sliding-window"])
def test_the_example_backend_passes(dtype, case):
    attention(dtype, case)(AcmePlatform())


def test_the_bf16_bug_needs_the_bf16_run():
    attention("float32", "soft-cap")(with_backend(Bf16Accumulation))


def test_a_token_mismatch_names_the_prompt_position_and_both_tokens():
    want = [[5, 6, 7, 8]] * len(suite.PROMPTS)
    got = [list(w) for w in want]
    assert suite.first_difference(got, want) is None
    got[2] = [5, 6, 9, 8]
    assert suite.first_difference(got, want).startswith(
        f"prompt 2 ({len(suite.PROMPTS[2])} tokens), generated token 2: got 9, transformers 7")
    got[2] = [5, 6]
    assert "generated token 2: got nothing, transformers 7" in suite.first_difference(got, want)

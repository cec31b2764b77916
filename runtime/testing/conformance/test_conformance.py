"""One platform, every hook its plugins implement, checked against the portable references."""
from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist

from runtime.attention_backends.base import AttentionBackend
from runtime.plugins.backend_choice import AttentionBackendError
from runtime.plugins.interfaces import CommunicatorSpec, GraphRunner, Platform
from runtime.plugins.selection import (HookAnswerError, explain_attention_backends,
                                       explain_platforms, hook_answer)
from runtime.testing.attention_check import CASES, check_attention
from runtime.testing.mla_check import LATENT, check_mla_attention
from runtime.testing.conformance.conftest import suite_model_info
from runtime.testing.conformance.op_check import PORTABLE, check_op, resolve
from runtime.testing.prefill_only_check import check_prefill_only

PROMPTS = [[1, 5, 9, 23, 77, 4, 300], [1] + list(range(100, 140)), [1, 42, 43], [1, 7] * 12]
MAX_TOKENS = 8
ENGINE = dict(kv_cache_memory="64MiB", max_num_batched_tokens=32, max_num_seqs=8)


def test_platform_is_detected(platform: Platform, device_name: str | None):
    rows = {r["name"]: r for r in explain_platforms(device_name)}
    assert rows[platform.name]["detected"] and rows[platform.name]["active"]


def test_platform_answers(platform: Platform):
    assert platform.device(0).type == platform.device_type
    # every worker asks with its local rank (tensor and pipeline parallel): a device all ranks
    # share (one on the host) answers the same device for each, never a refusal
    assert platform.device(1).type == platform.device_type, \
        f"device(1) answers {platform.device(1)}, not a {platform.device_type!r} device"
    assert platform.default_dtype() in platform.supported_dtypes()
    assert isinstance(platform.describe(), dict)
    platform.synchronize()
    assert platform.measure_peak_memory(lambda: None) >= 0
    assert platform.kv_cache_memory_bytes(None, 0) > 0
    assert platform.kv_cache_memory_bytes(1 << 20, 0) == 1 << 20


def _backend(hook, platform, model_info, requested=None) -> type[AttentionBackend]:
    backend = hook.runtime_attention_backend(platform=platform, model=model_info,
                                             requested=requested)
    assert backend is not None, f"no plugin supplies attention for {platform.name}"
    assert issubclass(backend, AttentionBackend) and backend.name
    return backend


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_attention_matches_the_reference(platform, model_info, dtype, case):
    """For every dtype the platform declares, the backend it chooses for that dtype."""
    dtype = DTYPES[dtype]
    if dtype not in platform.supported_dtypes():
        pytest.skip(f"{platform.name} does not declare {dtype}")
    sinks = CASES[case].sinks is not None
    mm_prefix = CASES[case].mm_prefix_ranges is not None
    info = dataclasses.replace(model_info, dtype=dtype, kv_cache_dtype=dtype,
                               sliding_window=CASES[case].sliding_window, attention_sinks=sinks,
                               mm_prefix_lm=mm_prefix)
    try:
        backend, who = hook_answer("runtime_attention_backend", platform=platform, model=info,
                                   requested=None)
    except HookAnswerError as e:
        if sinks and isinstance(e.__cause__, AttentionBackendError):
            pytest.skip(f"models with attention sinks are refused on {platform.name}: {e}")
        if mm_prefix and isinstance(e.__cause__, AttentionBackendError):
            pytest.skip(f"models whose image tokens attend both ways are refused on "
                        f"{platform.name}: {e}")
        raise
    assert backend is not None, f"no plugin supplies attention for {platform.name} in {dtype}"
    if CASES[case].logits_soft_cap is not None and not backend.supports_logits_soft_cap:
        pytest.skip(f"{backend.name} declares no logit soft-capping (it refuses such models)")
    assert not sinks or backend.supports_attention_sinks, (
        f"{backend.name} ({who}) is chosen for a model with attention sinks but declares no "
        f"supports_attention_sinks: the candidate list must refuse it when "
        f"model.attention_sinks is set (runtime.platforms.common.offer_backend does)")
    assert not mm_prefix or backend.supports_mm_prefix, (
        f"{backend.name} ({who}) is chosen for a model whose image tokens attend both ways but "
        f"declares no supports_mm_prefix: the candidate list must refuse it when "
        f"model.mm_prefix_lm is set (runtime.platforms.common.offer_backend does)")
    check_attention(backend, dtype, platform.device(0), CASES[case],
                    label=f"{backend.name} (answered by {who})")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_mla_attention_matches_the_reference(platform, model_info, dtype):
    """The backend chosen for a multi-head latent attention (DeepSeek-V3) layer, against
    float32 MLA math, for every dtype the platform declares; a platform that offers no MLA
    backend refuses such models, which the check then only asserts."""
    dtype = DTYPES[dtype]
    if dtype not in platform.supported_dtypes():
        pytest.skip(f"{platform.name} does not declare {dtype}")
    info = dataclasses.replace(model_info, dtype=dtype, kv_cache_dtype=dtype,
                               attention_kind="mla", head_size=LATENT, num_kv_heads=1)
    try:
        backend, who = hook_answer("runtime_attention_backend", platform=platform, model=info,
                                   requested=None)
    except HookAnswerError as e:
        if isinstance(e.__cause__, AttentionBackendError):
            pytest.skip(f"MLA models are refused on {platform.name}: {e}")
        raise
    assert backend is not None and backend.kind == "mla", \
        f"{platform.name} answered {backend} for an MLA layer"
    check_mla_attention(backend, dtype, platform.device(0),
                        label=f"{backend.name} (answered by {who})")


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_pooling_attention_matches_plain_attention(platform, model_info, test_dtype, causal):
    """A pooling model's steps (whole requests, no KV cache; bidirectional for encoders) on the
    backend the platform chooses for a pooling model."""
    info = dataclasses.replace(model_info, dtype=test_dtype, kv_cache_dtype=test_dtype,
                               pooling=True)
    try:
        backend, who = hook_answer("runtime_attention_backend", platform=platform, model=info,
                                   requested=None)
    except HookAnswerError as e:
        if isinstance(e.__cause__, AttentionBackendError):
            pytest.skip(f"pooling models are refused on {platform.name}: {e}")
        raise
    assert backend is not None, f"no plugin supplies attention for {platform.name}"
    assert backend.supports_encoder_attention, (
        f"{backend.name} ({who}) is chosen for a pooling model but declares no "
        f"supports_encoder_attention: the candidate list must refuse it when model.pooling is "
        f"set (offer_backend does)")
    check_prefill_only(backend, test_dtype, platform.device(0), causal,
                       label=f"{backend.name} (answered by {who})")


@pytest.mark.parametrize("model", ["pooling", "fp8 KV cache", "mla"])
def test_candidates_honour_what_each_backend_declares(hook, platform, model_info, model):
    """Selection takes a usable candidate at its word: a hand-built list must itself refuse a
    backend whose declarations rule the model out (offer_backend checks them)."""
    info = {"pooling": dataclasses.replace(model_info, pooling=True),
            "fp8 KV cache": dataclasses.replace(model_info, kv_cache_dtype=torch.float8_e4m3fn),
            "mla": dataclasses.replace(model_info, attention_kind="mla", head_size=LATENT,
                                       num_kv_heads=1)}[model]
    for candidates in hook.runtime_attention_backend_candidates(platform=platform, model=info):
        for c in candidates:
            if c.backend is None:
                continue
            ok, why = c.backend.supports_kv_cache_dtype(info.dtype, info.kv_cache_dtype)
            assert ok, (f"candidate {c.name} is offered as usable for a model with an "
                        f"{info.kv_cache_dtype} KV cache, but its supports_kv_cache_dtype "
                        f"refuses it ({why}): check it before listing the backend as usable")
            assert not info.pooling or c.backend.supports_encoder_attention, (
                f"candidate {c.name} is offered as usable for a pooling model, but declares no "
                f"supports_encoder_attention: refuse it when model.pooling is set")
            assert c.backend.kind == info.attention_kind, (
                f"candidate {c.name} ({c.backend.kind}) is offered as usable for a model whose "
                f"layers are {info.attention_kind}: refuse it (offer_backend does)")


def test_unknown_backend_is_refused_clearly(hook, platform, model_info):
    with pytest.raises(ValueError, match="no-such-backend"):
        _backend(hook, platform, model_info, "no-such-backend")


def test_backend_candidates_explain_the_choice(platform, model_info):
    report = explain_attention_backends(platform, model_info)
    assert report["error"] is None and report["chosen"]
    rows = report["backends"]
    assert sum(r["chosen"] for r in rows) == 1
    assert all(r["reason"] for r in rows if not r["usable"]), "every refusal needs its reason"


def test_graph_runner(hook, platform, model_info):
    runner = hook.runtime_graph_runner(platform=platform, model=model_info, enforce_eager=False)
    if runner is None:
        pytest.skip(f"no graph runner for {platform.name}: the engine runs eagerly")
    assert isinstance(runner, GraphRunner) and runner.name
    eager = hook.runtime_graph_runner(platform=platform, model=model_info, enforce_eager=True)
    assert eager is None or isinstance(eager, GraphRunner)


_generations: dict[tuple, list[list[int]]] = {}


def _generate(model: str, platform: Platform, dtype: torch.dtype,
              enforce_eager: bool = False) -> list[list[int]]:
    """Greedy tokens for PROMPTS from an engine on the platform (each setting run once)."""
    key = (model, platform.name, dtype, enforce_eager)
    if key not in _generations:
        from runtime import LLM, SamplingParams
        llm = LLM(model, device=platform.name, dtype=str(dtype).removeprefix("torch."),
                  enforce_eager=enforce_eager, **ENGINE)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        _generations[key] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    return _generations[key]


def test_generate_matches_transformers(platform, test_dtype, tiny_model):
    if test_dtype != torch.float32:
        pytest.skip(f"{platform.name} has no float32: greedy parity needs it")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    got = _generate(tiny_model, platform, torch.float32)
    backend, who = hook_answer("runtime_attention_backend", platform=platform,
                               model=suite_model_info(torch.float32), requested=None)
    problem = first_difference(got, want)
    assert problem is None, (f"greedy tokens on platform {platform.name}, attention backend "
                             f"{backend.name} ({who}), float32, differ from transformers: "
                             f"{problem}")


def first_difference(got: list[list[int]], want: list[list[int]]) -> str | None:
    """Where two sets of generated tokens first part: the prompt, the position, both tokens."""
    for i, (g, w) in enumerate(zip(got, want)):
        at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if at is None and len(g) != len(w):
            at = min(len(g), len(w))
        if at is not None:
            token = lambda ids: ids[at] if at < len(ids) else "nothing"  # noqa: E731
            return (f"prompt {i} ({len(PROMPTS[i])} tokens), generated token {at}: got "
                    f"{token(g)}, transformers {token(w)} (got {g}, want {w})")
    return None


def test_recorded_and_eager_runs_agree(platform, tiny_model):
    """The graph runner (CUDA graphs, XLA buckets, torch.compile …) changes no token."""
    dtype = platform.default_dtype()
    assert _generate(tiny_model, platform, dtype) == \
           _generate(tiny_model, platform, dtype, enforce_eager=True)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(PORTABLE))
def test_custom_op_matches_the_portable_one(platform, name, dtype):
    """The op the layers run (a composite as composed from the platform's parts), in every dtype
    the platform declares (a kernel's bf16 path is a path of its own), on zero, tiny, huge,
    strided and odd-sized rows."""
    dtype = DTYPES[dtype]
    if dtype not in platform.supported_dtypes():
        pytest.skip(f"{platform.name} does not declare {dtype}")
    op, who = resolve(platform, name)
    if op is None:
        pytest.skip(f"{platform.name} keeps the portable {name}")
    check_op(op, who, name, dtype, platform.device(0))


def test_quantization_kernel_hook_answers(hook, platform):
    answers = {m: hook.runtime_quantization_kernel(platform=platform, method=m, params={})
               for m in ("int8", "int4", "fp8")}
    if all(a is None for a in answers.values()):
        pytest.skip(f"{platform.name} supplies no quantization kernel (portable ones run)")
    # A weight-only int8/int4 kernel computes the same product as the method's reference.
    from runtime.quantization.weight_only import Int4Config, Int8Config
    device = platform.device(0)
    for config in (Int8Config(), Int4Config(group_size=32, symmetric=False)):
        kernel = hook.runtime_quantization_kernel(platform=platform, method=config.name,
                                                  params=config.kernel_params())
        if kernel is None or not kernel.supports(64, 128):
            continue
        torch.manual_seed(0)
        w, x = torch.randn(64, 128, device=device), torch.randn(5, 128, device=device)
        q = config.quantize(w, torch.float32)
        ours, ref = torch.nn.Module(), torch.nn.Module()
        kernel.pack(ours, q)
        config.reference_kernel().pack(ref, q)
        torch.testing.assert_close(kernel.apply(ours, x).float().cpu(),
                                   config.reference_kernel().apply(ref, x).float().cpu(),
                                   atol=1e-3, rtol=1e-3)


def test_communicator_of_one_rank(hook, platform):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    comm = hook.runtime_communicator(platform=platform,
                                     spec=CommunicatorSpec([0], 0, f"tcp://127.0.0.1:{port}"))
    if comm is None:
        pytest.skip(f"{platform.name} supplies no communicator")
    try:
        x = torch.arange(4.0, device=platform.device(0))
        assert torch.equal(comm.all_reduce(x.clone()).cpu(), x.cpu())
        assert comm.all_gather(x, dim=0).shape == (4,)
        assert (comm.rank, comm.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()

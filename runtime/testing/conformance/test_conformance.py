"""One platform, every hook its plugins implement, checked against the portable references."""
from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist

from runtime.attention_backends.base import AttentionBackend
from runtime.plugins.interfaces import CommunicatorSpec, GraphRunner, Platform
from runtime.plugins.ops import add_rms_norm, rms_norm, rotary_embedding, silu_and_mul
from runtime.plugins.selection import explain_attention_backends, explain_platforms, hook_answer
from runtime.testing.attention_check import CASES, check_attention
from runtime.testing.prefill_only_check import check_prefill_only

PROMPTS = [[1, 5, 9, 23, 77, 4, 300], [1] + list(range(100, 140)), [1, 42, 43], [1, 7] * 12]
MAX_TOKENS = 8
ENGINE = dict(kv_cache_memory="64MiB", max_num_batched_tokens=32, max_num_seqs=8)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def test_platform_is_detected(platform: Platform, device_name: str | None):
    rows = {r["name"]: r for r in explain_platforms(device_name)}
    assert rows[platform.name]["detected"] and rows[platform.name]["active"]


def test_platform_answers(platform: Platform):
    assert platform.device(0).type == platform.device_type
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
def test_attention_matches_the_portable_backend(platform, model_info, dtype, case):
    """For every dtype the platform declares, the backend it chooses for that dtype."""
    dtype = DTYPES[dtype]
    if dtype not in platform.supported_dtypes():
        pytest.skip(f"{platform.name} does not declare {dtype}")
    info = dataclasses.replace(model_info, dtype=dtype, kv_cache_dtype=dtype,
                               sliding_window=CASES[case].sliding_window)
    backend, who = hook_answer("runtime_attention_backend", platform=platform, model=info,
                               requested=None)
    assert backend is not None, f"no plugin supplies attention for {platform.name} in {dtype}"
    if CASES[case].logits_soft_cap is not None and not backend.supports_logits_soft_cap:
        pytest.skip(f"{backend.name} declares no logit soft-capping (it refuses such models)")
    check_attention(backend, dtype, platform.device(0), CASES[case],
                    label=f"{backend.name} (answered by {who})")


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_pooling_attention_matches_plain_attention(platform, model_info, test_dtype, causal):
    """A pooling model's steps (whole requests, no KV cache; bidirectional for encoders) on the
    backend the platform chooses for a pooling model."""
    info = dataclasses.replace(model_info, dtype=test_dtype, kv_cache_dtype=test_dtype,
                               pooling=True)
    backend, who = hook_answer("runtime_attention_backend", platform=platform, model=info,
                               requested=None)
    assert backend is not None, f"no plugin supplies attention for {platform.name}"
    if not backend.supports_encoder_attention:
        pytest.skip(f"{backend.name} declares no prefill-only attention (pooling models are "
                    f"refused on {platform.name})")
    check_prefill_only(backend, test_dtype, platform.device(0), causal,
                       label=f"{backend.name} (answered by {who})")


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
    assert _generate(tiny_model, platform, torch.float32) == want


def test_recorded_and_eager_runs_agree(platform, tiny_model):
    """The graph runner (CUDA graphs, XLA buckets, torch.compile …) changes no token."""
    dtype = platform.default_dtype()
    assert _generate(tiny_model, platform, dtype) == \
           _generate(tiny_model, platform, dtype, enforce_eager=True)


CUSTOM_OPS = {
    "rms_norm": (rms_norm, lambda d, t: (torch.randn(7, 64, device=d, dtype=t),
                                         torch.randn(64, device=d, dtype=t), 1e-6)),
    "add_rms_norm": (add_rms_norm, lambda d, t: (torch.randn(7, 64, device=d, dtype=t),
                                                 torch.randn(7, 64, device=d, dtype=t),
                                                 torch.randn(64, device=d, dtype=t), 1e-6)),
    "silu_and_mul": (silu_and_mul, lambda d, t: (torch.randn(7, 128, device=d, dtype=t),)),
    # positions, query [T, 4 heads * 64], key [T, 2 heads * 64], cos|sin cache, head size
    "rotary_embedding": (rotary_embedding, lambda d, t: (
        torch.tensor([0, 3, 9, 1, 30, 31, 2], device=d),
        torch.randn(7, 256, device=d, dtype=t), torch.randn(7, 128, device=d, dtype=t),
        torch.randn(32, 64, device=d), 64)),
}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(CUSTOM_OPS))
def test_custom_op_matches_the_portable_one(platform, name, dtype):
    """In every dtype the platform declares (a kernel's bf16 path is a path of its own)."""
    dtype = DTYPES[dtype]
    if dtype not in platform.supported_dtypes():
        pytest.skip(f"{platform.name} does not declare {dtype}")
    op, who = hook_answer("runtime_custom_op", platform=platform, name=name)
    if op is None:
        pytest.skip(f"{platform.name} keeps the portable {name}")
    portable, make_args = CUSTOM_OPS[name]
    args = make_args(platform.device(0), dtype)
    own_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # may be in place
    tol = _tolerance(dtype)
    to_host = lambda out: tuple(o.float().cpu() for o in out) if isinstance(out, tuple) \
        else out.float().cpu()
    torch.testing.assert_close(to_host(op(*own_args)), to_host(portable(*args)), atol=tol,
                               rtol=tol, msg=lambda m: f"{name} answered by {who}, "
                               f"{str(dtype).removeprefix('torch.')}: {m}")


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

"""CUDA engine checks, run by tests/device/run.sh on a GPU (skipped elsewhere): section 1 (decode
graphs against eager against transformers), 3d-3h (each backend alone against the portable one,
one process per backend; the float32 engines) and 6 (the engine at --gpu-memory-utilization 0.9,
memory around graph capture)."""
import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from runtime import LLM, SamplingParams  # noqa: E402
from runtime.attention_backends.torch_paged import TorchPagedAttention  # noqa: E402
from runtime.platforms.cuda import graph_runner  # noqa: E402
from runtime.platforms.cuda.graph_runner import CudaGraphRunner, replay_size  # noqa: E402
from runtime.plugins.interfaces import ModelInfo  # noqa: E402
from runtime.plugins.manager import reset_plugin_manager  # noqa: E402
from runtime.plugins.selection import select_platform  # noqa: E402
from runtime.testing.paged_batch import run_two_steps  # noqa: E402
from runtime.testing.tiny_model import build_tiny_llama  # noqa: E402
from tests.device.model import model_path  # noqa: E402

GiB = 1 << 30
PROMPTS = [[1, 5, 9, 23, 77, 4, 300], [1] + list(range(100, 160)), [1, 42, 43], [1, 7] * 30,
           [1, 3, 4], [1, 8, 9, 10, 11]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(kv_cache_memory="256MiB", max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    reset_plugin_manager()
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny")), head_dim=64,
                            hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """The batch size of every decode step replayed as a graph."""
    sizes: list[int] = []

    def counted(graph_sizes, num_tokens, metadata):
        bs = replay_size(graph_sizes, num_tokens, metadata)
        if bs is not None:
            sizes.append(bs)
        return bs

    monkeypatch.setattr(graph_runner, "replay_size", counted)
    return sizes


def engine(path: str, **kwargs) -> LLM:
    """An engine, after the memory of those no longer referenced is given back."""
    gc.collect()
    torch.cuda.empty_cache()
    return LLM(path, **kwargs)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def transformers_tokens(path: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]


def test_graphs_eager_and_transformers_agree(tiny, replays):
    """Section 1: float32 graphs == eager == transformers; bfloat16 graphs == eager."""
    want = transformers_tokens(tiny)
    for dtype in ("float32", "bfloat16"):
        eager = tokens(engine(tiny, dtype=dtype, enforce_eager=True, **ENGINE))
        llm = engine(tiny, dtype=dtype, **ENGINE)
        runner = llm.engine.core.executor.worker.runner.graph_runner
        assert runner.name == "cuda graphs" and runner.sizes == [1, 2, 4, 8]
        graphs = tokens(llm)
        assert graphs == eager, dtype
        if dtype == "float32":
            assert graphs == want
        assert replays and set(replays) <= {1, 2, 4, 8}
        print(f"{dtype}: graph replays by batch size "
              f"{ {s: replays.count(s) for s in sorted(set(replays))} }")
        replays.clear()
        del llm, runner


ALWAYS_THERE = {"triton_paged", "torch_paged"}


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("name", ["flash_attn", "flashinfer", "triton_paged", "torch_paged"])
def test_backend_matches_the_portable_one(name, block_size, dtype, kv):
    """Sections 3d-3g: one backend of the CUDA platform alone, two steps over the paged
    cache, against the portable backend in float32 on the host from the same rounded inputs
    (and the same FP8 cache); one the platform refuses here is skipped with its reason."""
    kv_dtype = dtype if kv == "auto" else torch.float8_e4m3fn
    cuda = select_platform("cuda")
    model = ModelInfo("LlamaForCausalLM", dtype, kv_dtype, 128, 16, 4, None, block_size)
    candidate = next(c for c in cuda.attention_backend_candidates(model) if c.name == name)
    if candidate.backend is None:
        assert name not in ALWAYS_THERE, candidate.reason
        pytest.skip(f"{name}: {candidate.reason}")
    shape = ([1, 1, 1, 9, 300], [17, 600, 257, 9, 700], block_size, 16, 4, 128)
    got = run_two_steps(candidate.backend, *shape, dtype, "cuda", kv_cache_dtype=kv_dtype)
    want = run_two_steps(TorchPagedAttention, *shape, torch.float32, "cpu", input_dtype=dtype,
                         kv_cache_dtype=None if kv == "auto" else kv_dtype)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", ["triton_paged", "torch_paged"])
def test_engine_in_float32_matches_transformers(tiny, backend):
    """Section 3h: the backends that compute float32, token for token."""
    llm = engine(tiny, dtype="float32", attention_backend=backend, **ENGINE)
    assert tokens(llm) == transformers_tokens(tiny)


def test_engine_at_09_with_graphs(tmp_path, monkeypatch, replays):
    """Section 6: the default engine (graphs on) at --gpu-memory-utilization 0.9: memory before
    and after graph capture, and generation afterwards within the budget."""
    seen = {}
    capture = CudaGraphRunner.capture

    def measured(self, forward, spec):
        for when, run in (("before", lambda: None),
                          ("after", lambda: capture(self, forward, spec))):
            run()
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            seen[when] = (total - free, torch.cuda.memory_reserved(), total)

    monkeypatch.setattr(CudaGraphRunner, "capture", measured)
    path = model_path(str(tmp_path))
    llm = engine(path, dtype="bfloat16", gpu_memory_utilization=0.9)
    worker = llm.engine.core.executor.worker
    runner = worker.runner.graph_runner
    (used0, torch0, total), (used1, torch1, _) = seen["before"], seen["after"]
    print(f"{path}: KV cache {worker.num_blocks} blocks; {len(runner.graphs)} graphs "
          f"(batch sizes up to {runner.sizes[-1]}); device used {used0 / GiB:.2f} -> "
          f"{used1 / GiB:.2f} GiB of {total / GiB:.1f} (torch reserved {torch0 / GiB:.2f} -> "
          f"{torch1 / GiB:.2f}); capture took {(used1 - used0) / 2**20:.0f} MiB")
    assert runner.name == "cuda graphs" and len(runner.graphs) == len(runner.sizes)
    prompts = [[1] + [(7 * i + j) % 400 + 3 for j in range(100)] for i in range(64)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs) and replays
    free, total = torch.cuda.mem_get_info()
    print(f"after generating: device used {(total - free) / GiB:.2f} GiB "
          f"({(total - free) / total:.1%}; budget 90%)")
    assert total - free <= 0.9 * total + 0.5 * GiB, "the engine went past its memory budget"

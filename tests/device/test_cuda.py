"""CUDA-only checks, run by tests/device/run.sh on a GPU (skipped elsewhere)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from runtime.attention_backends.torch_paged import TorchPagedAttention  # noqa: E402
from runtime.platforms.cuda import graph_runner  # noqa: E402
from runtime.platforms.cuda.graph_runner import replay_size  # noqa: E402
from runtime.plugins.interfaces import ModelInfo  # noqa: E402
from runtime.plugins.manager import reset_plugin_manager  # noqa: E402
from runtime.plugins.selection import explain_attention_backends, select_platform  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.testing.paged_batch import run_two_steps  # noqa: E402
from runtime.testing.tiny_model import build_tiny_llama  # noqa: E402

PROMPTS = [[1, 5, 9, 23, 77, 4, 300], [1] + list(range(100, 160)), [1, 42, 43], [1, 7] * 30,
           [1, 3, 4], [1, 8, 9, 10, 11]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(kv_cache_memory="256MiB", max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    reset_plugin_manager()
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny")), head_dim=64,
                            hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_every_usable_backend_matches_the_portable_one(dtype, block_size):
    from runtime.platforms.cuda import attention_candidates
    cuda = select_platform("cuda")
    model = ModelInfo("LlamaForCausalLM", dtype, dtype, 128, 16, 4, None, block_size)
    print({r["name"]: r["why"] for r in explain_attention_backends(cuda, model)["backends"]})
    shape = ([1, 1, 1, 9, 300], [17, 600, 257, 9, 700], block_size, 16, 4, 128)
    want = run_two_steps(TorchPagedAttention, *shape, torch.float32, "cpu")
    usable = [c for c in attention_candidates(cuda, model) if c.backend is not None]
    assert "triton_paged" in {c.name for c in usable}
    for c in usable:
        got = run_two_steps(c.backend, *shape, dtype, "cuda")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=3e-2, rtol=3e-2, msg=c.name)


def test_decode_graphs_are_recorded_and_replayed(tiny, monkeypatch):
    eager = _tokens(LLM(tiny, dtype="bfloat16", enforce_eager=True, **ENGINE))
    llm = LLM(tiny, dtype="bfloat16", **ENGINE)
    runner = llm.engine.core.executor.worker.runner.graph_runner
    assert runner.name == "cuda graphs" and runner.sizes == [1, 2, 4, 8]
    replays = []

    def counted(sizes, num_tokens, metadata):
        bs = replay_size(sizes, num_tokens, metadata)
        replays.append(bs)
        return bs

    monkeypatch.setattr(graph_runner, "replay_size", counted)
    assert _tokens(llm) == eager
    replays = [bs for bs in replays if bs is not None]
    assert replays and set(replays) <= {1, 2, 4, 8}
    print(f"graph replays by batch size: { {s: replays.count(s) for s in sorted(set(replays))} }")


@pytest.mark.parametrize("backend", ["triton_paged", "torch_paged"])
def test_engine_in_float32_matches_transformers(tiny, backend):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    llm = LLM(tiny, dtype="float32", attention_backend=backend, **ENGINE)
    assert _tokens(llm) == want


def test_kv_cache_sized_from_free_memory(tiny):
    llm = LLM(tiny, dtype="bfloat16", gpu_memory_utilization=0.3, max_num_seqs=8)
    worker = llm.engine.core.executor.worker
    per_block = llm.engine.model_config.kv_bytes_per_block(16, torch.bfloat16)
    total = torch.cuda.get_device_properties(0).total_memory
    cap = 8 * -(-llm.engine.model_config.max_model_len // 16)
    assert worker.num_blocks == cap or worker.num_blocks * per_block <= 0.3 * total
    print(f"KV cache: {worker.num_blocks} blocks ({worker.num_blocks * per_block / 2**20:.0f} MiB)")

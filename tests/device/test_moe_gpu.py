"""Section 2a of tests/device/run.sh: the Triton `fused_moe` compiled for the GPU against the
portable op in float32 on the host (bf16 too, which the CPU interpreter lacks), at
Mixtral-like and Qwen3-MoE-like widths; recorded in a CUDA graph (nothing waits on the host);
and a tiny random Mixtral through the engine, graphs and eager, against transformers."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from runtime import LLM, SamplingParams  # noqa: E402
from runtime.platforms.cuda.fused_moe_triton import fused_moe  # noqa: E402
from runtime.plugins import ops  # noqa: E402
from runtime.testing.tiny_model import VOCAB_SIZE, save_tokenizer  # noqa: E402
from tests.models.test_moe_kernels import check, random_case  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (tokens, hidden, intermediate, experts, top_k): decode, a prefill chunk, many small experts
SHAPES = [(1, 1024, 1792, 8, 2), (300, 1024, 1792, 8, 2), (64, 512, 192, 64, 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel(shape, dtype):
    check(random_case(0, *shape, dtype, "cuda"), dtype)


def test_kernel_with_experts_on_other_ranks():
    x, w13, w2, weights, ids = random_case(1, 40, 256, 512, 8, 2, torch.bfloat16, "cuda")
    check((x, w13, w2, weights, torch.where(ids >= 4, -1, ids)), torch.bfloat16)


def test_cuda_graph_records_the_op():
    case = random_case(2, 16, 256, 512, 8, 2, torch.bfloat16, "cuda")
    x, w13, w2, weights, ids = (t.clone() for t in case)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    fresh = random_case(3, 16, 256, 512, 8, 2, torch.bfloat16, "cuda")
    for held, new in zip((x, weights, ids), (fresh[0], fresh[3], fresh[4])):
        held.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids))


def test_tiny_mixtral_graphs_and_eager_match_transformers(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2, initializer_range=0.2,
                           max_position_embeddings=512, tie_word_embeddings=False)
    hf = MixtralForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    save_tokenizer(str(tmp_path))
    prompts = [[1, 5, 9, 23, 77, 4, 300], [1] + list(range(100, 160)), [1, 42, 43]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    for eager in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", enforce_eager=eager, kv_cache_memory="64MiB",
                  max_num_seqs=4)
        experts = next(m for m in llm.engine.core.executor.worker.runner.model.modules()
                       if hasattr(m, "w13_weight"))
        assert experts.op is fused_moe and experts.op is not ops.fused_moe
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want

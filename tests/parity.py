"""Reference outputs from Hugging Face transformers, for parity tests."""
from __future__ import annotations

import torch

# Prompts of different lengths (token ids), so batches mix short and long prefills.
PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],
    [1] + list(range(300, 337)),
    [1, 9690, 28, 2683, 253, 1377, 2439, 30, 198] * 3,
    [1, 77, 88],
    list(range(1000, 1090)),
]

# Our logprobs are compared with log_softmax of the reference logits, both in float32.
LOGPROB_ATOL = 2e-3


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from `generate`, and the logprob of each chosen token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_matches_hf(outputs, references) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, references)):
        sample = out.outputs[0]
        assert sample.token_ids == tokens, f"prompt {i}: greedy tokens differ from transformers"
        ours = [next(iter(pos.values())).logprob for pos in sample.logprobs]
        worst = max(abs(a - b) for a, b in zip(ours, logprobs))
        assert worst < LOGPROB_ATOL, f"prompt {i}: logprob differs by {worst:.2e}"

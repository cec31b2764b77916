"""What the vision-language tests share: the requests and sampling they send, and transformers'
greedy `generate` as the reference (the tokens and each one's logprob)."""
from __future__ import annotations

import torch

from runtime import SamplingParams


def request(prompt: str, images: list) -> dict | str:
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


def greedy(n: int = 6, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos, logprobs=0)


def hf_greedy(model, inputs: dict, n: int) -> tuple[list[int], list[float]]:
    """`n` greedy tokens of a transformers model on `inputs` (its processor's output) and
    their logprobs."""
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens)]


def generate_recording_chunks(llm, requests: list, params: SamplingParams) -> tuple[list, list]:
    """`llm.generate` of `requests`, and every chunk the scheduler gave them: (request, first
    token, end) per request per step."""
    scheduler = llm.engine.core.scheduler
    schedule, chunks = scheduler.schedule, []

    def recording():
        out = schedule()
        chunks.extend((r, r.num_computed_tokens, r.num_computed_tokens + n)
                      for r, n in out.scheduled)
        return out

    scheduler.schedule = recording
    try:
        return llm.generate(requests, params), chunks
    finally:
        scheduler.schedule = schedule


def chunks_ending_inside_images(chunks: list) -> list[tuple[int, int]]:
    return [(lo, hi) for r, lo, hi in chunks for f in r.mm_features if f.offset < hi < f.end]


def generate_counting_encodes(llm, prompts: list[str], images: list) -> tuple[list, int, int]:
    """Each prompt with `images`, one request after another: the outputs, how many items the
    vision encoder encoded meanwhile, and how many the encoder cache served."""
    cache = llm.engine.core.scheduler.encoder_cache
    encoder = llm.engine.core.executor.worker.runner.encoder
    hits, encoded = cache.num_hits, encoder.num_encoded_items
    outs = [llm.generate(request(p, images), greedy(), use_tqdm=False)[0] for p in prompts]
    return outs, encoder.num_encoded_items - encoded, cache.num_hits - hits


def generate_counting_prefix_hits(llm, prompt: str, images: list) -> list[tuple[int, list[int]]]:
    """`prompt` with each of `images` in turn: per run, the tokens the prefix cache gave and
    the greedy tokens."""
    kv, runs = llm.engine.core.kv, []
    for image in images:
        hits = kv.num_cache_hits
        out = llm.generate(request(prompt, [image]), greedy(), use_tqdm=False)[0]
        runs.append((kv.num_cache_hits - hits, out.outputs[0].token_ids))
    return runs

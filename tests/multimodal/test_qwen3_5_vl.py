"""Qwen3.5's vision variant (the hybrid gated delta-net + attention text model with Qwen3-VL's
vision tower, M-RoPE) against transformers on tiny random models, in float32: greedy tokens
and logprobs for a text-only prompt and prompts of one and two images, the images' placeholder
runs split over 8-token prefill chunks; a repeated prompt resumed from the prefix cache's
recurrent-state checkpoints; preemption; the MoE variant on one image. The reference expands
each <|image_pad|> as tests/multimodal/test_qwen_vl.py does (no torchvision). The tokenizer
is byte-level (one token per byte of the prompt's text)."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.testing.tiny_vlm import QWEN_VL_IMAGE as IMAGE
from runtime.testing.tiny_vlm import QWEN_VL_TOKENS, build_tiny_qwen3_5_vl, random_image

PAD = QWEN_VL_TOKENS["<|image_pad|>"]
LOGPROB_TOL = 2e-3
# 56x56: 4 image tokens; 112x84: 12 (a 3x4 grid of merge units)
PROMPTS = [("tell a story", []),
           (f"see {IMAGE} it", [(1, (56, 56))]),
           (f"a {IMAGE} or {IMAGE} b", [(2, (112, 84)), (3, (84, 112))])]


def load_hf(path: str):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return (AutoImageProcessor.from_pretrained(path, backend="pil"),
            AutoTokenizer.from_pretrained(path), model.eval())


def hf_generate(hf, prompt: str, specs, n: int = 6) -> tuple[list[int], list[float]]:
    image_processor, tokenizer, model = hf
    ids = tokenizer(prompt)["input_ids"]
    inputs = {}
    if specs:
        out = image_processor(images=images_of(specs), return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for i in ids for t in ([i] * next(counts) if i == PAD else [i])]
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    input_ids = torch.tensor([ids])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         mm_token_type_ids=(input_ids == PAD).int(), **inputs,
                         max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, input_ids.shape[1]:].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens)]


def images_of(specs) -> list:
    return [random_image(seed, size) for seed, size in specs]


def request(prompt: str, specs) -> dict | str:
    return {"prompt": prompt, "multi_modal_data": {"image": images_of(specs)}} if specs \
        else prompt


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, logprobs=0)


def assert_matches(out, expected) -> float:
    tokens, logprobs = expected
    got = out.outputs[0]
    assert got.token_ids == tokens
    ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
    gap = max(abs(a - b) for a, b in zip(ours, logprobs))
    assert gap < LOGPROB_TOL
    return gap


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("qwen3_5_vl")))


@pytest.fixture(scope="module")
def hf(model_path):
    return load_hf(model_path)


def test_greedy_tokens_and_logprobs_match_transformers(model_path, hf):
    # 8-token steps split the 12-token images over chunks; blocks of 8 checkpoint the
    # delta-net state at every block's end
    llm = LLM(model_path, dtype="float32", max_num_batched_tokens=8, block_size=8,
              max_num_encoder_input_tokens=32, encoder_cache_size=64)
    outs = llm.generate([request(p, s) for p, s in PROMPTS], greedy(), use_tqdm=False)
    expected = [hf_generate(hf, p, s) for p, s in PROMPTS]
    for out, want in zip(outs, expected):
        assert_matches(out, want)
    kv = llm.engine.core.kv
    hits = kv.num_cache_hits
    again = llm.generate(request(*PROMPTS[2]), greedy(), use_tqdm=False)[0]
    assert kv.num_cache_hits - hits >= 16  # resumed past both images' first blocks
    assert_matches(again, expected[2])


def test_preempted_requests_resume_at_their_positions(model_path, hf):
    # 8 blocks of 8 tokens (and 2 state slots): two 21-token prompts growing to 37 tokens (5
    # blocks each) cannot both stay
    small = LLM(model_path, dtype="float32", block_size=8, kv_cache_memory="28KiB",
                max_num_seqs=2, max_num_batched_tokens=16, max_num_encoder_input_tokens=16,
                encoder_cache_size=16, enable_prefix_caching=False)
    cases = [(f"ab {IMAGE} cdef", [(400, (112, 84))]),
             (f"gh {IMAGE} ijkl", [(401, (84, 112))])]
    outs = small.generate([request(p, s) for p, s in cases], greedy(16), use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for (prompt, specs), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, specs, 16)[0]


def test_moe_variant_matches_transformers(tmp_path):
    """Its checkpoint also holds a tensor of a multi-token-prediction head, as the released
    ones do, which both engines skip."""
    from safetensors.torch import load_file, save_file
    path = build_tiny_qwen3_5_vl(str(tmp_path), moe=True)
    weights = str(tmp_path / "model.safetensors")
    save_file({**load_file(weights), "mtp.fc.weight": torch.zeros(64, 128)}, weights,
              metadata={"format": "pt"})
    llm = LLM(path, dtype="float32", max_num_batched_tokens=8, max_num_encoder_input_tokens=16,
              encoder_cache_size=16)
    out = llm.generate(request(*PROMPTS[1]), greedy(), use_tqdm=False)[0]
    assert_matches(out, hf_generate(load_hf(path), *PROMPTS[1]))

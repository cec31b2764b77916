"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL against transformers on tiny random models: greedy tokens and
logprobs for text-only prompts and prompts of one and two images of different sizes (so of
different token counts), with each image's placeholder run split over prefill chunks; M-RoPE
positions equal to transformers' `get_rope_index`; the encoder cache and the prefix cache
on a repeated image; preemption.

transformers 5 cannot build `Qwen2VLProcessor` without torchvision (its video processor), so
the reference takes the model's image processor and expands each <|image_pad|> to
`image_grid_thw.prod() // merge**2` copies, as the processor's `replace_image_token` does."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM
from runtime.multimodal.mrope import mrope_positions
from runtime.testing.tiny_vlm import QWEN_VL_IMAGE as IMAGE
from runtime.testing.tiny_vlm import QWEN_VL_TOKENS, build_tiny_qwen_vl, random_image
from tests.multimodal.helpers import greedy, hf_greedy, request

PAD = QWEN_VL_TOKENS["<|image_pad|>"]
LOGPROB_TOL = 2e-3
# 56x56: 4 image tokens; 112x84: 12 (a 3x4 grid of merge units, two windows in Qwen2.5-VL;
# Qwen3-VL resamples its 4x4 position table to it)
PROMPTS = [("w10 w11 w12 w13", []),
           (f"w10 {IMAGE} w11 w12", [(1, (56, 56))]),
           (f"w20 {IMAGE} w21 {IMAGE} w22", [(2, (112, 84)), (3, (84, 112))])]


@pytest.fixture(scope="module", params=["2", "2.5", "3"])
def version(request):
    return request.param


@pytest.fixture(scope="module")
def model_path(version, tmp_path_factory):
    return build_tiny_qwen_vl(str(tmp_path_factory.mktemp("qwen_vl")), version)


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    return (AutoImageProcessor.from_pretrained(model_path, backend="pil"),
            AutoTokenizer.from_pretrained(model_path), model.eval())


@pytest.fixture(scope="module")
def llm(model_path):
    # an 8-token step splits the 12-token images over chunks; blocks of 8 show prefix hits
    return LLM(model_path, dtype="float32", max_num_batched_tokens=8, block_size=8,
               max_num_encoder_input_tokens=32, encoder_cache_size=64, enable_prefix_caching=True)


def hf_inputs(hf, prompt: str, images: list) -> dict[str, torch.Tensor]:
    image_processor, tokenizer, _ = hf
    ids = tokenizer(prompt)["input_ids"]
    if not images:
        return {"input_ids": torch.tensor([ids])}
    out = image_processor(images=images, return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2).tolist())
    ids = [t for i in ids for t in ([i] * next(counts) if i == PAD else [i])]
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"], "mm_token_type_ids": (input_ids == PAD).int()}


def hf_generate(hf, prompt: str, images: list, n: int = 6) -> tuple[list[int], list[float]]:
    inputs = hf_inputs(hf, prompt, images)
    return hf_greedy(hf[2], {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])},
                     n)


def images_of(specs) -> list:
    return [random_image(seed, size) for seed, size in specs]


def test_greedy_tokens_and_logprobs_match_transformers(llm, hf):
    cases = [(prompt, images_of(specs)) for prompt, specs in PROMPTS]
    outs = llm.generate([request(p, i) for p, i in cases], greedy(ignore_eos=False))
    for (prompt, images), out in zip(cases, outs):
        tokens, logprobs = hf_generate(hf, prompt, images)
        got = out.outputs[0]
        assert got.token_ids == tokens, prompt
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL, prompt


def test_placeholders_and_positions_equal_transformers(llm, hf):
    prompt, specs = PROMPTS[2]
    images = images_of(specs)
    _, ids, features = llm.engine.processor.prepare(
        {"prompt": prompt, "multi_modal_data": {"image": images}})
    inputs = hf_inputs(hf, prompt, images)
    assert ids == inputs["input_ids"][0].tolist()
    assert [(f.offset, f.length) for f in features] == [(2, 12), (17, 12)]
    expected, delta = hf[2].model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    n = len(ids)
    assert mrope_positions(features, 0, n).tolist() == expected[:, 0].tolist()
    split = [mrope_positions(features, a, b) for a, b in ((0, 5), (5, 20), (20, n + 3))]
    assert torch.cat([torch.from_numpy(s) for s in split], 1)[:, n:].tolist() == \
        [[n + int(delta) + k for k in range(3)]] * 3  # generated tokens continue from max + 1
    assert torch.cat([torch.from_numpy(s) for s in split], 1)[:, :n].tolist() == \
        expected[:, 0].tolist()


def test_repeated_image_hits_the_encoder_and_prefix_caches(llm, hf):
    cache = llm.engine.core.scheduler.encoder_cache
    encoder = llm.engine.core.executor.worker.runner.encoder
    kv = llm.engine.core.kv
    image = random_image(100, (112, 84))
    prompt = f"w30 w31 w32 w33 w34 w35 w36 {IMAGE} w37 w38"  # 8 text tokens, then the image
    hits, encoded, blocks = cache.num_hits, encoder.num_encoded_items, kv.num_cache_hits
    first = llm.generate(request(prompt, [image]), greedy(ignore_eos=False), use_tqdm=False)[0]
    other = llm.generate(request("w40 " + prompt, [image]), greedy(ignore_eos=False),
                         use_tqdm=False)[0]
    again = llm.generate(request(prompt, [image]), greedy(ignore_eos=False), use_tqdm=False)[0]
    assert encoder.num_encoded_items - encoded == 1
    assert cache.num_hits - hits >= 1
    assert kv.num_cache_hits - blocks >= 16  # the text block and the image's first block
    expected = hf_generate(hf, prompt, [image])[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
    assert other.outputs[0].token_ids == hf_generate(hf, "w40 " + prompt, [image])[0]


def test_chat_image_part_equals_the_prompt_with_the_vision_tokens(llm):
    image = random_image(300, (56, 56))
    direct = llm.generate(request(f"{IMAGE}\nw5 w6 ", [image]), greedy(ignore_eos=False),
                          use_tqdm=False)[0].outputs[0].token_ids
    reply = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                   {"type": "text", "text": "w5 w6"}]}],
                     greedy(ignore_eos=False), use_tqdm=False)
    assert reply[0].outputs[0].token_ids == direct


def test_preempted_requests_resume_at_their_positions(version, model_path, hf):
    if version != "2":
        pytest.skip("the positions are the same code for every architecture")
    # 6 blocks of 8 tokens: two 21-token prompts growing to 37 cannot both stay
    small = LLM(model_path, dtype="float32", block_size=8, kv_cache_memory="24KiB",
                max_num_batched_tokens=16, max_num_encoder_input_tokens=16,
                encoder_cache_size=16, enable_prefix_caching=False)
    prompts = [f"w5 w6 {IMAGE} w7 w8 w9", f"w9 w8 {IMAGE} w7 w6 w5"]
    images = [random_image(400, (112, 84)), random_image(401, (84, 112))]
    outs = small.generate([request(p, [i]) for p, i in zip(prompts, images)],
                          greedy(16, ignore_eos=False),
                          use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for prompt, image, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, [image], 16)[0]

"""LLaVA-NeXT against transformers on a tiny random model: greedy tokens and logprobs for text
alone, one image and two images of other sizes and aspect ratios (each its own anyres token
count), with image placeholder runs split over prefill chunks, the encoder cache shared by
requests with the same image, prefix caching that never serves one image's blocks to another,
and preemption."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from runtime import LLM
from runtime.testing.tiny_vlm import build_tiny_llava_next, random_image
from tests.multimodal.helpers import (generate_counting_encodes, generate_counting_prefix_hits,
                                     greedy, hf_greedy, request)

LOGPROB_TOL = 1e-3  # float32 on both sides
STEP_TOKENS = 16  # fewer than any image's placeholders: every image is split over steps
CASES = [("w5 w6 w7", []),
         ("w5 <image> w6 w7", [(48, 40)]),
         ("w8 <image> w9 <image> w10", [(40, 72), (80, 30)])]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_llava_next(str(tmp_path_factory.mktemp("llava_next")))


def hf_reference(model_path: str):
    """transformers' processor and model of the folder."""
    from transformers import (AutoImageProcessor, AutoTokenizer,
                              LlavaNextForConditionalGeneration, LlavaNextProcessor)
    processor = LlavaNextProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model_path, backend="pil"),
        tokenizer=AutoTokenizer.from_pretrained(model_path), patch_size=8,
        vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1)
    model = LlavaNextForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    return processor, model.eval()


@pytest.fixture(scope="module")
def hf(model_path):
    return hf_reference(model_path)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", max_num_batched_tokens=STEP_TOKENS, block_size=8,
               max_num_encoder_input_tokens=128, encoder_cache_size=256,
               enable_prefix_caching=True)


def hf_generate(hf, prompt: str, images: list, n: int = 6) -> tuple[list[int], list[float]]:
    processor, model = hf
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    return hf_greedy(model, inputs, n)


def test_greedy_tokens_and_logprobs_match_transformers(llm, hf):
    images = [[random_image(10 * i + k, size) for k, size in enumerate(sizes)]
              for i, (_, sizes) in enumerate(CASES)]
    outs = llm.generate([request(p, im) for (p, _), im in zip(CASES, images)], greedy())
    for (prompt, _), ims, out in zip(CASES, images, outs):
        tokens, logprobs = hf_generate(hf, prompt, ims)
        got = out.outputs[0]
        assert got.token_ids == tokens, prompt
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL, prompt


def test_each_image_takes_its_own_token_count(llm, hf):
    processor, _ = hf
    prompt, sizes = CASES[2]
    images = [random_image(1, sizes[0]), random_image(2, sizes[1])]
    _, ids, features = llm.engine.processor.prepare(request(prompt, images))
    assert ids == processor(text=prompt, images=images, return_tensors="pt")[
        "input_ids"][0].tolist()
    # tall and wide images unpad to different grids; both runs span several steps
    assert [(f.offset, f.length) for f in features] == [(1, 56), (58, 52)]
    assert min(f.length for f in features) > STEP_TOKENS


def test_requests_sharing_an_image_encode_it_once(llm, hf):
    image = random_image(100, (60, 44))
    prompts = ["w20 <image> w21", "w30 w31 <image> w32 w33"]
    outs, encoded, cache_hits = generate_counting_encodes(llm, prompts, [image])
    assert encoded == 1
    assert cache_hits == 1
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, [image])[0]


def test_same_text_with_another_image_gets_no_prefix_hit_on_its_blocks(llm, hf):
    # 8 text tokens (one block, shared), then the image's 36 placeholders and 2 words
    prompt = "w40 w41 w42 w43 w44 w45 w46 w47 <image> w48 w49"
    first, second = random_image(200, (32, 32)), random_image(201, (32, 32))
    runs = generate_counting_prefix_hits(llm, prompt, [first, second, first])
    assert [hits for hits, _ in runs] == [0, 8, 40]  # the text block; then every full block
    assert runs[0][1] == runs[2][1] == hf_generate(hf, prompt, [first])[0]
    assert runs[1][1] == hf_generate(hf, prompt, [second])[0]


def test_qwen2_language_model_matches_transformers(tmp_path):
    path = build_tiny_llava_next(str(tmp_path), text_model="qwen2")
    qwen = hf_reference(path)
    image = random_image(500, (56, 36))
    out = LLM(path, dtype="float32", max_num_batched_tokens=STEP_TOKENS,
              max_num_encoder_input_tokens=128, encoder_cache_size=128).generate(
        request("w5 <image> w6", [image]), greedy(), use_tqdm=False)[0].outputs[0]
    tokens, logprobs = hf_generate(qwen, "w5 <image> w6", [image])
    assert out.token_ids == tokens
    ours = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL


def test_preempted_requests_encode_again_and_match_transformers(model_path, hf):
    # 8 blocks of 8 tokens: two 41-token prompts growing to 57 tokens cannot both stay
    small = LLM(model_path, dtype="float32", block_size=8, kv_cache_memory="32KiB",
                max_num_batched_tokens=16, max_num_encoder_input_tokens=64,
                encoder_cache_size=64, enable_prefix_caching=False)
    prompts = ["w5 w6 <image> w7 w8 w9", "w9 w8 <image> w7 w6 w5"]
    images = [random_image(400, (32, 32)), random_image(401, (20, 20))]
    outs = small.generate([request(p, [i]) for p, i in zip(prompts, images)], greedy(16),
                          use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for prompt, image, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, [image], 16)[0]


def test_full_feature_strategy_is_refused_naming_it(model_path, tmp_path):
    # each tile's CLS would have to sit in the unpadded patch grid: transformers cannot either
    path = shutil.copytree(model_path, tmp_path / "full")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config,
                                                  "vision_feature_select_strategy": "full"}))
    with pytest.raises(ValueError, match="vision_feature_select_strategy 'full' is not "
                                         "supported; supported: default"):
        LLM(str(path), dtype="float32")

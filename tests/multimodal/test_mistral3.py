"""Mistral 3 (Pixtral encoder) against transformers on a tiny random model: greedy tokens and
logprobs for text alone, one image and two images of other sizes and aspect ratios (each its
own [IMG] rows with [IMG_BREAK] and [IMG_END]), with image runs split over prefill chunks, the
encoder cache shared by requests with the same image, prefix caching that never serves one
image's blocks to another, and preemption.

transformers' PixtralProcessor needs torchvision, so the reference prompt is expanded here by
its rule (`expand`), from the image processor's `image_sizes`."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from runtime import LLM
from runtime.testing.tiny_vlm import MISTRAL3_TOKENS, build_tiny_mistral3, random_image
from tests.multimodal.helpers import (generate_counting_encodes, generate_counting_prefix_hits,
                                     greedy, hf_greedy, request)

LOGPROB_TOL = 1e-3  # float32 on both sides
STEP_TOKENS = 8  # fewer than any image's placeholders: every image is split over steps
UNIT = 16  # pixels per merged patch: 8-pixel patches, merged 2x2
IMG, BREAK, END = (MISTRAL3_TOKENS[t] for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
CASES = [("w6 w7 w8", []),
         ("w6 [IMG] w7 w8", [(48, 40)]),
         ("w9 [IMG] w10 [IMG] w11", [(40, 72), (64, 30)])]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_mistral3(str(tmp_path_factory.mktemp("mistral3")))


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoImageProcessor, AutoTokenizer, Mistral3ForConditionalGeneration
    model = Mistral3ForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    return (AutoTokenizer.from_pretrained(model_path),
            AutoImageProcessor.from_pretrained(model_path, backend="pil"), model.eval())


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", max_num_batched_tokens=STEP_TOKENS, block_size=8,
               max_num_encoder_input_tokens=32, encoder_cache_size=64,
               enable_prefix_caching=True)


def expand(ids: list[int], image_sizes: torch.Tensor) -> list[int]:
    """PixtralProcessor's prompt: each [IMG] becomes rows of [IMG] closed by [IMG_BREAK], the
    last by [IMG_END]."""
    out, sizes = [], iter(image_sizes.tolist())
    for t in ids:
        if t != IMG:
            out.append(t)
            continue
        h, w = next(sizes)
        run = ([IMG] * (w // UNIT) + [BREAK]) * (h // UNIT)
        out += run[:-1] + [END]
    return out


def hf_inputs(hf, prompt: str, images: list) -> dict:
    tokenizer, image_processor, _ = hf
    ids = tokenizer(prompt)["input_ids"]
    if not images:
        return {"input_ids": torch.tensor([ids])}
    pixels = image_processor(images=images, return_tensors="pt",
                             patch_size={"height": UNIT, "width": UNIT})
    return {"input_ids": torch.tensor([expand(ids, pixels["image_sizes"])]), **pixels}


def hf_generate(hf, prompt: str, images: list, n: int = 6) -> tuple[list[int], list[float]]:
    inputs = hf_inputs(hf, prompt, images)
    return hf_greedy(hf[2], {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])},
                     n)


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


def test_each_image_takes_its_own_rows(llm, hf):
    prompt, sizes = CASES[2]
    images = [random_image(1, sizes[0]), random_image(2, sizes[1])]
    _, ids, features = llm.engine.processor.prepare(request(prompt, images))
    assert ids == hf_inputs(hf, prompt, images)["input_ids"][0].tolist()
    # 72x40 (height x width) is scaled to 64x35, then padded up to 64x48: 4 rows of 3;
    # 30x64 is padded up to 32x64: 2 rows of 4
    assert [(f.offset, f.length) for f in features] == [(1, 16), (18, 10)]
    assert ids[1:17] == ([IMG] * 3 + [BREAK]) * 3 + [IMG] * 3 + [END]
    assert min(f.length for f in features) > STEP_TOKENS


def test_images_encoded_together_attend_only_within_each_image(llm):
    prompt, sizes = CASES[2]
    images = [random_image(3, sizes[0]), random_image(4, sizes[1])]
    _, _, features = llm.engine.processor.prepare(request(prompt, images))
    model = llm.engine.core.executor.worker.runner.model
    items = [f.tensors() for f in features]
    with torch.inference_mode():
        together = model.embed_multimodal(items)
        alone = [model.embed_multimodal([item])[0] for item in items]
    # The batched call's projections have more rows, so the host's timed product choice may
    # run them through another product (another fp32 summation order: 1e-5 apart); attending
    # across images would put them orders of magnitude further apart.
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_chat_image_parts_equal_the_placeholder_prompt(llm):
    image = random_image(300, (40, 56))
    direct = llm.generate(request("[IMG]\nw6 w7 ", [image]), greedy(),
                          use_tqdm=False)[0].outputs[0].token_ids
    reply = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                    {"type": "text", "text": "w6 w7"}]}],
                     greedy(), use_tqdm=False)
    assert reply[0].outputs[0].token_ids == direct


def test_requests_sharing_an_image_encode_it_once(llm, hf):
    image = random_image(100, (60, 44))
    prompts = ["w20 [IMG] w21", "w30 w31 [IMG] w32 w33"]
    outs, encoded, cache_hits = generate_counting_encodes(llm, prompts, [image])
    assert encoded == 1
    assert cache_hits == 1
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, [image])[0]


def test_same_text_with_another_image_gets_no_prefix_hit_on_its_blocks(llm, hf):
    # 8 text tokens (one block, shared), then the image's 20 tokens and 2 words
    prompt = "w40 w41 w42 w43 w44 w45 w46 w47 [IMG] w48 w49"
    first, second = random_image(200, (64, 48)), random_image(201, (64, 48))
    runs = generate_counting_prefix_hits(llm, prompt, [first, second, first])
    assert [hits for hits, _ in runs] == [0, 8, 24]  # the text block; then every full block
    assert runs[0][1] == runs[2][1] == hf_generate(hf, prompt, [first])[0]
    assert runs[1][1] == hf_generate(hf, prompt, [second])[0]


def test_preempted_requests_encode_again_and_match_transformers(model_path, hf):
    # 8 blocks of 8 tokens: a 20- and a 21-token prompt growing by 24 cannot both stay
    small = LLM(model_path, dtype="float32", block_size=8, kv_cache_memory="32KiB",
                max_num_batched_tokens=16, max_num_encoder_input_tokens=32,
                encoder_cache_size=32, enable_prefix_caching=False)
    prompts = ["w6 w7 [IMG] w8 w9 w10", "w10 w9 [IMG] w8 w7 w6"]
    images = [random_image(400, (64, 48)), random_image(401, (48, 64))]
    outs = small.generate([request(p, [i]) for p, i in zip(prompts, images)], greedy(24),
                          use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for prompt, image, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, [image], 24)[0]


def test_several_feature_layers_are_refused_naming_it(model_path, tmp_path):
    # the projector's norm is one layer wide, in transformers too
    path = shutil.copytree(model_path, tmp_path / "layers")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vision_feature_layer": [-2, -1]}))
    with pytest.raises(ValueError, match=r"vision_feature_layer \[-2, -1\] is not supported"):
        LLM(str(path), dtype="float32")

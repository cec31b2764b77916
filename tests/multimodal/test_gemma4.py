"""Gemma 4 vision against transformers on a tiny random model: greedy tokens and logprobs for
text, one image and two images of other sizes (each its own token count), an image's tokens
attending both ways in the sliding layer only, chunks that never end inside an image,
prefix-cache hits that never cross images, preemption, and the refusals (audio, video,
every token bidirectional)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from runtime import LLM
from runtime.testing.tiny_vlm import GEMMA4_IMAGE as IMAGE, build_tiny_gemma4_vl, random_image
from tests.multimodal.helpers import (chunks_ending_inside_images,
                                      generate_recording_chunks, greedy, hf_greedy,
                                      request)

BOI, EOI, IMAGE_ID = 3, 4, 5
PROMPTS = ["w6 w7 w8 w9 w10 w11", f"w6 w7 {IMAGE} w8 w9 w10 w11",
           f"w12 {IMAGE} w13 {IMAGE} w14 w15"]
SIZES = [(48, 40), (64, 30)]  # 63 and 60 image tokens
LOGPROB_TOL = 1e-4  # float32 on both sides (the largest gap measured: 2.4e-6)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_gemma4_vl(str(tmp_path_factory.mktemp("gemma4")))


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma4ForConditionalGeneration
    model = Gemma4ForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    return (AutoImageProcessor.from_pretrained(model_path, backend="pil"),
            AutoTokenizer.from_pretrained(model_path), model.eval())


@pytest.fixture(scope="module")
def llm(model_path):
    # a 72-token step budget takes one image's run whole but not two; blocks of 4 make
    # prefix-cache hits visible within a short prompt
    return LLM(model_path, dtype="float32", max_num_batched_tokens=72, block_size=4,
               enable_prefix_caching=True)


def hf_prompt(hf, prompt: str, images: list) -> tuple[torch.Tensor, dict]:
    """transformers' processor's expansion (it needs torchvision for its video part, so it
    is written out here): each image token becomes <|image>, its soft tokens, <image|>."""
    image_processor, tokenizer, _ = hf
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    pixels = image_processor(images=images, return_tensors="pt") if images else {}
    counts = iter(pixels["num_soft_tokens_per_image"].tolist() if images else [])
    expanded = [t for i in ids for t in ([BOI] + [IMAGE_ID] * next(counts) + [EOI]
                                         if i == IMAGE_ID else [i])]
    inputs = {"input_ids": torch.tensor([expanded])}
    if images:
        inputs.update(pixel_values=pixels["pixel_values"],
                      image_position_ids=pixels["image_position_ids"],
                      mm_token_type_ids=(inputs["input_ids"] == IMAGE_ID).long())
    return inputs["input_ids"], inputs


def hf_generate(hf, prompt: str, images: list, n: int = 6) -> tuple[list[int], list[float]]:
    ids, inputs = hf_prompt(hf, prompt, images)
    return hf_greedy(hf[2], {**inputs, "attention_mask": torch.ones_like(ids)}, n)


def assert_matches(hf, prompt: str, images: list, out, n: int = 6) -> None:
    tokens, logprobs = hf_generate(hf, prompt, images, n)
    got = out.outputs[0]
    assert got.token_ids == tokens, prompt
    ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL, prompt


def test_greedy_tokens_and_logprobs_match_transformers_with_whole_image_chunks(llm, hf):
    images = {p: [random_image(10 * i + k, SIZES[k]) for k in range(p.count(IMAGE))]
              for i, p in enumerate(PROMPTS)}
    outs, chunks = generate_recording_chunks(llm, [request(p, images[p]) for p in PROMPTS],
                                             greedy())
    cut = chunks_ending_inside_images(chunks)
    assert not cut, f"chunks ending inside an image: {cut}"
    for prompt, out in zip(PROMPTS, outs):
        assert_matches(hf, prompt, images[prompt], out)


def test_expanded_prompt_has_each_images_own_token_count(llm, hf):
    images = [random_image(1, SIZES[0]), random_image(2, SIZES[1])]
    _, ids, features = llm.engine.processor.prepare(request(PROMPTS[2], images))
    assert ids == hf_prompt(hf, PROMPTS[2], images)[0][0].tolist()
    assert [(f.offset, f.length) for f in features] == [(2, 63), (68, 60)]
    # the bench's reference inputs (padded to the longest item) give transformers' features
    image_processor, _, model = hf
    padded = image_processor(images=images, return_tensors="pt")
    want = model.model.get_image_features(padded["pixel_values"],
                                          padded["image_position_ids"]).pooler_output
    got = model.model.get_image_features(
        *llm.engine.processor.multimodal.layout.hf_inputs(features).values()).pooler_output
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))


def test_image_attention_is_bidirectional_in_the_sliding_layer_only(llm):
    layers = llm.engine.core.executor.worker.runner.model.language_model.model.layers
    assert [layer.self_attn.attn.mm_prefix for layer in layers] == [True, False]


def test_prefix_cache_hits_never_cross_images(llm, hf):
    kv = llm.engine.core.kv
    # 4 text tokens (one block, shared), <|image>, the 63 image tokens, <image|>, 3 words
    prompt = f"w40 w41 w42 w43 {IMAGE} w48 w49 w50"
    first, second = random_image(200), random_image(201)
    runs = []
    for image in (first, second, first):
        hits = kv.num_cache_hits
        out = llm.generate(request(prompt, [image]), greedy(), use_tqdm=False)[0]
        runs.append(kv.num_cache_hits - hits)
        assert_matches(hf, prompt, [image], out)
    assert runs == [0, 4, 68]  # the text block; then all but the block of the last token


def test_prefix_hit_that_ends_inside_an_image(llm, hf):
    kv = llm.engine.core.kv
    # image tokens 3..65: the 16 cached blocks end inside it, the rest attend both ways to
    # its cached keys and to each other
    prompt = f"w52 w53 {IMAGE}"
    image = random_image(300)
    runs = []
    for _ in range(2):
        hits = kv.num_cache_hits
        out = llm.generate(request(prompt, [image]), greedy(), use_tqdm=False)[0]
        runs.append(kv.num_cache_hits - hits)
        assert_matches(hf, prompt, [image], out)
    assert runs == [0, 64]


def test_preempted_requests_encode_again_and_match_transformers(model_path, hf):
    # 28 blocks of 4 tokens: two 68-token prompts growing to 80 tokens cannot both stay
    small = LLM(model_path, dtype="float32", block_size=4, kv_cache_memory="56KiB",
                max_num_batched_tokens=72, enable_prefix_caching=False)
    prompts = [f"w5 {IMAGE} w7 w8", f"w9 {IMAGE} w7 w6"]
    images = [random_image(400), random_image(401)]
    outs = small.generate([request(p, [i]) for p, i in zip(prompts, images)], greedy(12),
                          use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for prompt, image, out in zip(prompts, images, outs):
        assert_matches(hf, prompt, [image], out, 12)


def test_a_step_budget_below_the_largest_image_is_refused(model_path):
    with pytest.raises(ValueError, match="takes an image's 70 tokens whole: "
                                         "max_num_batched_tokens 69 is too small"):
        LLM(model_path, dtype="float32", max_num_batched_tokens=69, block_size=4)


def test_video_is_refused(llm):
    with pytest.raises(ValueError, match="'video', which this model cannot take"):
        llm.generate({"prompt": f"w5 {IMAGE}", "multi_modal_data": {"video": [random_image(0)]}},
                     greedy())


@pytest.mark.parametrize("change, reason", [
    ({"audio_config": {"hidden_size": 64}}, "audio tower is not supported"),
    ({"text_config": {"use_bidirectional_attention": "all"}},
     "use_bidirectional_attention 'all' .* is not supported")])
def test_refused_configs(model_path, tmp_path, change, reason):
    shutil.copytree(model_path, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    for key, value in change.items():
        config[key] = {**(config.get(key) or {}), **value}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=reason):
        LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=72)

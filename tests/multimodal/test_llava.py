"""LLaVA 1.5 against transformers on a tiny random model: greedy tokens and logprobs with the
image's placeholder run split over prefill chunks, the encoder cache shared by requests with
the same image, and prefix caching that never serves one image's blocks to another."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM
from runtime.testing.tiny_vlm import build_tiny_llava, random_image
from tests.multimodal.helpers import (generate_counting_encodes, generate_counting_prefix_hits,
                                     greedy, hf_greedy)

PROMPTS = ["w5 w6 <image> w7 w8 w9", "<image> w10 w11", "w12 <image> w13 <image> w14"]
LOGPROB_TOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import (AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration,
                              LlavaProcessor)
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model_path, backend="pil"),
        tokenizer=AutoTokenizer.from_pretrained(model_path), patch_size=8,
        vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1)
    model = LlavaForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    return processor, model.eval()


@pytest.fixture(scope="module")
def llm(model_path):
    # An 8-token step budget splits every image's 16 placeholders over several steps; blocks
    # of 8 make prefix-cache hits visible within a short prompt.
    return LLM(model_path, dtype="float32", max_num_batched_tokens=8, block_size=8,
               max_num_encoder_input_tokens=32, encoder_cache_size=64, enable_prefix_caching=True)


def hf_generate(hf, prompt: str, images: list, n: int = 6) -> tuple[list[int], list[float]]:
    processor, model = hf
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    return hf_greedy(model, inputs, n)


def test_greedy_tokens_and_logprobs_match_transformers(llm, hf):
    images = {p: [random_image(10 * i + k) for k in range(p.count("<image>"))]
              for i, p in enumerate(PROMPTS)}
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": images[p]}}
                         for p in PROMPTS], greedy())
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_generate(hf, prompt, images[prompt])
        got = out.outputs[0]
        assert got.token_ids == tokens, prompt
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL, prompt


def test_expanded_prompt_records_each_image(llm, hf):
    processor, _ = hf
    prompt = PROMPTS[2]
    images = [random_image(1), random_image(2)]
    _, ids, features = llm.engine.processor.prepare(
        {"prompt": prompt, "multi_modal_data": {"image": images}})
    assert ids == processor(text=prompt, images=images, return_tensors="pt")[
        "input_ids"][0].tolist()
    assert [(f.offset, f.length) for f in features] == [(1, 16), (18, 16)]
    assert features[0].identifier != features[1].identifier


def test_requests_sharing_an_image_encode_it_once(llm, hf):
    image = random_image(100)
    prompts = ["w20 <image> w21", "w30 w31 <image> w32 w33"]
    outs, encoded, cache_hits = generate_counting_encodes(llm, prompts, [image])
    assert encoded == 1
    assert cache_hits == 1
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, [image])[0]


def test_same_text_with_another_image_gets_no_prefix_hit_on_its_blocks(llm, hf):
    # 8 text tokens (one block, shared), then the image's 16 placeholders (two blocks)
    prompt = "w40 w41 w42 w43 w44 w45 w46 w47 <image> w48 w49"
    first, second = random_image(200), random_image(201)
    runs = generate_counting_prefix_hits(llm, prompt, [first, second, first])
    assert [hits for hits, _ in runs] == [0, 8, 24]  # the text block; then all three blocks
    assert runs[0][1] == runs[2][1] == hf_generate(hf, prompt, [first])[0]
    assert runs[1][1] == hf_generate(hf, prompt, [second])[0]


def test_chat_image_parts_equal_the_placeholder_prompt(llm):
    import base64
    import io
    image = random_image(300)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    direct = llm.generate({"prompt": "<image>\nw5 w6 ", "multi_modal_data": {"image": image}},
                          greedy(), use_tqdm=False)[0].outputs[0].token_ids
    for part in ({"type": "image_pil", "image_pil": image},
                 {"type": "image_url", "image_url": {"url": url}}):
        reply = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "w5 w6"}]}],
                         greedy(), use_tqdm=False)
        assert reply[0].outputs[0].token_ids == direct


@pytest.mark.parametrize("prompt, data, words", [
    ("w5 w6", {"image": "IMAGE"}, "0 image placeholders ('<image>') for 1 images"),
    ("<image> w5", {"audio": b""}, "'audio', which this model cannot take"),
    ("<image> w5", {"image": "data:image/png;base64,AAAA"}, "image 0: the image cannot be"),
    ("<image> w5", {"image": "file:///etc/hostname"}, "file:// image URLs are off"),
])
def test_bad_multimodal_input_is_refused_naming_it(llm, prompt, data, words):
    data = {k: random_image(0) if v == "IMAGE" else v for k, v in data.items()}
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        llm.generate({"prompt": prompt, "multi_modal_data": data}, greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_preempted_requests_encode_again_and_match_transformers(model_path, hf):
    # 8 blocks of 8 tokens: two 21-token prompts growing to 45 tokens cannot both stay
    small = LLM(model_path, dtype="float32", block_size=8, kv_cache_memory="32KiB",
                max_num_batched_tokens=16, max_num_encoder_input_tokens=16,
                encoder_cache_size=16, enable_prefix_caching=False)
    prompts = ["w5 w6 <image> w7 w8 w9", "w9 w8 <image> w7 w6 w5"]
    images = [random_image(400), random_image(401)]
    outs = small.generate([{"prompt": p, "multi_modal_data": {"image": i}}
                           for p, i in zip(prompts, images)], greedy(24), use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for prompt, image, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, [image], 24)[0]

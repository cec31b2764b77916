"""Gemma 3 vision against transformers on a tiny random model: greedy tokens and logprobs with
an image's tokens attending to each other both ways (under the sliding window too), chunks
that never end inside an image, the encoder cache shared by requests with the same image,
prefix-cache hits (one resuming inside an image, none across images) and preemption."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.plugins.interfaces import ModelInfo
from runtime.testing.tiny_vlm import build_tiny_gemma3_vl, random_image
from runtime.platforms.common import offer_backend
from tests.multimodal.helpers import (chunks_ending_inside_images, generate_counting_encodes,
                                     generate_recording_chunks, greedy, hf_greedy, request)

IMAGE = "<start_of_image>"
PROMPTS = ["w6 w7 w8 w9 w10 w11", f"w6 w7 {IMAGE} w8 w9 w10 w11",
           f"w12 {IMAGE} w13 {IMAGE} w14 w15"]
LOGPROB_TOL = 1e-4  # float32 on both sides (the largest gap measured: 2e-6)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_gemma3_vl(str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import (AutoImageProcessor, AutoTokenizer, Gemma3ForConditionalGeneration,
                              Gemma3Processor)
    processor = Gemma3Processor(
        image_processor=AutoImageProcessor.from_pretrained(model_path, backend="pil"),
        tokenizer=AutoTokenizer.from_pretrained(model_path), image_seq_length=4)
    model = Gemma3ForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    return processor, model.eval()


@pytest.fixture(scope="module")
def llm(model_path):
    # A 6-token step budget would end the first chunk of PROMPTS[1] (image tokens 3..6)
    # inside its image; blocks of 4 make prefix-cache hits visible within a short prompt.
    return LLM(model_path, dtype="float32", max_num_batched_tokens=6, block_size=4,
               enable_prefix_caching=True)


def hf_generate(hf, prompt: str, images: list, n: int = 6) -> tuple[list[int], list[float]]:
    processor, model = hf
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    return hf_greedy(model, inputs, n)


def assert_matches(hf, prompt: str, images: list, out, n: int = 6) -> None:
    tokens, logprobs = hf_generate(hf, prompt, images, n)
    got = out.outputs[0]
    assert got.token_ids == tokens, prompt
    ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL, prompt


def test_greedy_tokens_and_logprobs_match_transformers_with_whole_image_chunks(llm, hf):
    images = {p: [random_image(10 * i + k) for k in range(p.count(IMAGE))]
              for i, p in enumerate(PROMPTS)}
    outs, chunks = generate_recording_chunks(llm, [request(p, images[p]) for p in PROMPTS],
                                             greedy())
    cut = chunks_ending_inside_images(chunks)
    assert not cut, f"chunks ending inside an image: {cut}"
    # the budget of 6 would have ended PROMPTS[1]'s first chunk at token 6, inside its image
    assert any(lo == 0 and hi == 3 for r, lo, hi in chunks if r.mm_features and
               len(r.mm_features) == 1)
    for prompt, out in zip(PROMPTS, outs):
        assert_matches(hf, prompt, images[prompt], out)


def test_expanded_prompt_is_the_processors(llm, hf):
    processor, _ = hf
    prompt = PROMPTS[2]
    images = [random_image(1), random_image(2)]
    _, ids, features = llm.engine.processor.prepare(request(prompt, images))
    assert ids == processor(text=prompt, images=images, return_tensors="pt")[
        "input_ids"][0].tolist()
    assert [(f.offset, f.length) for f in features] == [(2, 4), (9, 4)]


def test_requests_sharing_an_image_encode_it_once(llm, hf):
    image = random_image(100)
    prompts = [f"w20 {IMAGE} w21", f"w30 w31 {IMAGE} w32 w33"]
    outs, encoded, cache_hits = generate_counting_encodes(llm, prompts, [image])
    assert encoded == 1
    assert cache_hits == 1
    for prompt, out in zip(prompts, outs):
        assert_matches(hf, prompt, [image], out)


def test_prefix_cache_hits_never_cross_images(llm, hf):
    kv = llm.engine.core.kv
    # 4 text tokens (one block, shared), then <start_of_image>, the 4 image tokens,
    # <end_of_image>: 13 tokens, 3 full blocks
    prompt = f"w40 w41 w42 w43 {IMAGE} w48 w49 w50"
    first, second = random_image(200), random_image(201)
    runs = []
    for image in (first, second, first):
        hits = kv.num_cache_hits
        out = llm.generate(request(prompt, [image]), greedy(), use_tqdm=False)[0]
        runs.append(kv.num_cache_hits - hits)
        assert_matches(hf, prompt, [image], out)
    assert runs == [0, 4, 12]  # the text block; then all three blocks


def test_prefix_hit_that_ends_inside_an_image(llm, hf):
    kv = llm.engine.core.kv
    # image tokens 3..6: the cached block 0 ends after the first, the rest attend both ways
    # to it (from the cache) and to each other
    prompt = f"w52 w53 {IMAGE}"
    image = random_image(300)
    runs = []
    for _ in range(2):
        hits = kv.num_cache_hits
        out = llm.generate(request(prompt, [image]), greedy(), use_tqdm=False)[0]
        runs.append(kv.num_cache_hits - hits)
        assert_matches(hf, prompt, [image], out)
    assert runs == [0, 4]


def test_chat_image_part_equals_the_placeholder_prompt(llm):
    image = random_image(500)
    direct = llm.generate(request(f"{IMAGE}\nw5 w6 ", [image]), greedy(), use_tqdm=False)
    reply = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                   {"type": "text", "text": "w5 w6"}]}],
                     greedy(), use_tqdm=False)
    assert reply[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


def test_torch_paged_backend_matches_transformers(model_path, hf):
    torch_llm = LLM(model_path, dtype="float32", attention_backend="torch_paged",
                    max_num_batched_tokens=8, block_size=4)
    prompt, images = PROMPTS[2], [random_image(20), random_image(21)]
    assert_matches(hf, prompt, images,
                   torch_llm.generate(request(prompt, images), greedy(), use_tqdm=False)[0])


def test_preempted_requests_encode_again_and_match_transformers(model_path, hf):
    # 6 blocks of 4 tokens: two 10-token prompts growing to 22 tokens cannot both stay
    small = LLM(model_path, dtype="float32", block_size=4, kv_cache_memory="12KiB",
                max_num_batched_tokens=8, enable_prefix_caching=False)
    prompts = [f"w5 w6 {IMAGE} w7 w8", f"w9 w8 {IMAGE} w7 w6"]
    images = [random_image(400), random_image(401)]
    outs = small.generate([request(p, [i]) for p, i in zip(prompts, images)], greedy(12),
                          use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for prompt, image, out in zip(prompts, images, outs):
        assert_matches(hf, prompt, [image], out, 12)


def test_pan_and_scan_is_refused(model_path, tmp_path):
    import json
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    from runtime.multimodal.processing import MultiModalProcessor
    shutil.copytree(model_path, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "preprocessor_config.json") as f:
        config = json.load(f)
    config.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=16,
                  pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
    with open(tmp_path / "preprocessor_config.json", "w") as f:
        json.dump(config, f)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    processor = MultiModalProcessor(str(tmp_path), AutoConfig.from_pretrained(tmp_path),
                                    tokenizer)
    with pytest.raises(ValueError, match="pan and scan .* is not supported"):
        processor.process(tokenizer.encode(f"w5 {IMAGE}"), {"image": random_image(0, (96, 24))})


def test_a_step_budget_below_an_image_is_refused(model_path):
    with pytest.raises(ValueError, match="takes an image's 4 tokens whole: "
                                         "max_num_batched_tokens 3 is too small"):
        LLM(model_path, dtype="float32", max_num_batched_tokens=3, block_size=4)


def test_a_backend_without_bidirectional_image_attention_is_refused():
    class CausalOnly(TorchPagedAttention):
        supports_mm_prefix = False

    model = ModelInfo("Gemma3ForConditionalGeneration", torch.float32, torch.float32, 32, 2, 1,
                      mm_prefix_lm=True)
    candidate = offer_backend("causal_only", CausalOnly, 0, model, "cpu", "test", [])
    assert candidate.backend is None
    assert "no bidirectional attention within an image's tokens" in candidate.reason
    assert offer_backend("torch_paged", TorchPagedAttention, 0, model, "cpu", "test",
                         []).backend is TorchPagedAttention

"""Idefics3 and SmolVLM against transformers on tiny random models: greedy tokens and logprobs
for text, an image whole or split into tiles and two images, with every image's placeholder
run split over prefill chunks; the encoder cache shared by requests with the same image;
prefix caching that never serves one image's blocks to another; preemption; chat image parts
through a template that reads content parts."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM
from runtime.multimodal.chat_parts import template_reads_parts
from runtime.testing.tiny_vlm import build_tiny_idefics3, random_image
from tests.multimodal.helpers import (generate_counting_encodes, generate_counting_prefix_hits,
                                     greedy, hf_greedy, request)

LOGPROB_TOL = 1e-4  # float32 on both sides
WIDE = (64, 32)  # split: 1 x 2 tiles and the global image
SQUARE = (48, 40)  # split: 2 x 2 tiles and the global image
CASES = [("w60 w61 w62", []), ("w60 <image> w61", [WIDE]),
         ("<image> w63 <image> w64", [SQUARE, WIDE])]
# (smolvlm, split, seed): SmolVLM on other random weights than Idefics3
VARIANTS = {"idefics3": (False, True, 0), "idefics3-whole": (False, False, 0),
            "smolvlm": (True, True, 1), "smolvlm-whole": (True, False, 1)}


def reference(path: str, image_seq_len: int = 4) -> tuple:
    """transformers' processor and model of a model folder."""
    from transformers import (AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer,
                              Idefics3Processor)
    # SmolVLMProcessor needs num2words (for video); its image prompt is Idefics3's
    processor = Idefics3Processor(AutoImageProcessor.from_pretrained(path, backend="pil"),
                                  AutoTokenizer.from_pretrained(path), image_seq_len=image_seq_len)
    return processor, AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32).eval()


def load(name: str, path: str) -> tuple:
    """(name, LLM, transformers processor, transformers model) of one variant. An 8-token
    step budget splits every image's run (7 to 34 tokens) over several steps."""
    llm = LLM(path, dtype="float32", max_num_batched_tokens=8, block_size=8,
              max_num_encoder_input_tokens=40, encoder_cache_size=80, enable_prefix_caching=True)
    return (name, llm, *reference(path))


@pytest.fixture(scope="module")
def idefics3_path(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model(request, tmp_path_factory, idefics3_path):
    if request.param == "idefics3":
        return load("idefics3", idefics3_path)
    path = build_tiny_idefics3(str(tmp_path_factory.mktemp(request.param)),
                               *VARIANTS[request.param])
    return load(request.param, path)


def hf_generate(model, prompt: str, images: list, n: int = 6) -> tuple[list[int], list[float]]:
    processor, hf = model[-2:]
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    return hf_greedy(hf, inputs, n)


def test_greedy_tokens_and_logprobs_match_transformers(model):
    _, llm, processor, _ = model
    images = [[random_image(10 * i + k, size) for k, size in enumerate(sizes)]
              for i, (_, sizes) in enumerate(CASES)]
    outs = llm.generate([request(p, i) for (p, _), i in zip(CASES, images)], greedy())
    for (prompt, _), imgs, out in zip(CASES, images, outs):
        _, ids, features = llm.engine.processor.prepare(request(prompt, imgs))
        assert ids == processor(text=prompt, images=imgs or None)["input_ids"][0]
        assert [ids[f.offset] for f in features] == [4] * len(imgs)  # each run: from <fake..>
        tokens, logprobs = hf_generate(model, prompt, imgs)
        got = out.outputs[0]
        assert got.token_ids == tokens, prompt
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL, prompt


def test_an_image_item_is_all_its_tiles(model):
    name, llm, processor, _ = model
    images = [random_image(1, SQUARE), random_image(2, WIDE)]
    _, ids, features = llm.engine.processor.prepare(request(CASES[2][0], images))
    tiles = [len(f.tensors()["pixel_values"]) for f in features]
    lengths = [f.length for f in features]
    if name.endswith("whole"):
        assert tiles == [1, 1] and lengths == [7, 7]
    else:  # per tile <fake><row_r_col_c> and 4 <image>s, a newline a row, the global image's 7
        assert tiles == [5, 3] and lengths == [4 * 6 + 2 + 1 + 7, 2 * 6 + 1 + 1 + 7]
    assert features[1].offset == features[0].end + 1
    # what the bench gives transformers for them: all the tiles, one a row
    pixels = processor(text=CASES[2][0], images=images, return_tensors="pt")["pixel_values"]
    ours = llm.engine.processor.multimodal.layout.hf_inputs(features)["pixel_values"]
    assert torch.equal(ours.flatten(0, 1), pixels.flatten(0, 1))
    assert ids[features[0].end - 1] == ids[features[1].offset] == 4


def test_requests_sharing_an_image_encode_it_once(model):
    _, llm, _, _ = model
    image = random_image(100, SQUARE)
    prompts = ["w70 <image> w71", "w72 w73 <image> w74 w75"]
    outs, encoded, cache_hits = generate_counting_encodes(llm, prompts, [image])
    assert encoded == 1
    assert cache_hits == 1
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(model, prompt, [image])[0]


def test_same_text_with_another_image_gets_no_prefix_hit_on_its_blocks(model):
    name, llm, _, _ = model
    # 8 text tokens (one block, shared), then the image's run (7: none of a full block)
    prompt = "w80 w81 w82 w83 w84 w85 w86 w87 <image> w88 w89 w90 w91 w92 w93 w94 w95 w96 w97"
    first, second = random_image(200, WIDE), random_image(201, WIDE)
    runs = generate_counting_prefix_hits(llm, prompt, [first, second, first])
    total = 8 + (7 if name.endswith("whole") else 21) + 10
    assert [hits for hits, _ in runs] == [0, 8, total // 8 * 8]
    assert runs[0][1] == runs[2][1] == hf_generate(model, prompt, [first])[0]
    assert runs[1][1] == hf_generate(model, prompt, [second])[0]


def test_chat_image_parts_become_the_templates_image_parts(model):
    import base64
    import io
    from types import SimpleNamespace

    from runtime.entrypoints.chat import ChatMedia, render_chat
    from runtime.entrypoints.tool_parsers.anthropic import anthropic_messages
    _, llm, _, _ = model
    image = random_image(300, WIDE)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert llm.engine.processor.multimodal.chat_parts()
    prompt = "system: w7<end_of_utterance>\nuser:<image> w5 w6<end_of_utterance>\nw50:"
    direct = llm.generate(request(prompt, [image]), greedy(), use_tqdm=False)[0]
    # a string content is a text part too: the template loops over every message's content
    reply = llm.chat([{"role": "system", "content": "w7"}, {"role": "user", "content": [
        {"type": "image_pil", "image_pil": image}, {"type": "text", "text": "w5 w6"}]}],
        greedy(), use_tqdm=False)[0]
    assert reply.prompt == prompt
    assert reply.outputs[0].token_ids == direct.outputs[0].token_ids
    media = ChatMedia(llm.engine.processor.multimodal)  # the server's routes
    messages = [{"role": "system", "content": media.text_of("w7")},
                {"role": "user", "content": media.text_of([
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "w5 w6"}])}]
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    assert render_chat(llm.tokenizer, messages, None) == ids
    media = ChatMedia(llm.engine.processor.multimodal)  # Anthropic's Messages
    data = base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "system", "content": media.text_of("w7")}, *anthropic_messages(
        [SimpleNamespace(role="user", content=[
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}},
            {"type": "text", "text": "w5 w6"}])], media.text_of)]
    assert render_chat(llm.tokenizer, messages, None) == ids
    assert media.parts.images == [url]
    # a template given in place of the tokenizer's is the one that decides
    plain = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    reply = llm.chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": image}, {"type": "text", "text": "w5 w6"}]}],
        greedy(), chat_template=plain, use_tqdm=False)[0]
    assert reply.prompt == "<image>\nw5 w6 "
    assert not ChatMedia(llm.engine.processor.multimodal, chat_template=plain).parts.as_parts


def test_tiles_of_another_size_than_the_position_table_match_transformers(tmp_path):
    # 48-pixel tiles: 6x6 patches onto the 4x4 position table (bucketed coordinates), 9
    # tokens a tile
    path = build_tiny_idefics3(str(tmp_path), tile=48)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16,
              max_num_encoder_input_tokens=64, encoder_cache_size=64)
    ref = reference(path, image_seq_len=9)
    prompt, images = "w60 <image> w61", [random_image(5, (96, 48))]
    got = llm.generate(request(prompt, images), greedy(), use_tqdm=False)[0].outputs[0]
    assert llm.engine.processor.prepare(request(prompt, images))[2][0].length == 2 * 11 + 2 + 12
    tokens, logprobs = hf_generate(ref, prompt, images)
    assert got.token_ids == tokens
    ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOL


def test_tiles_the_pixel_shuffle_cannot_fold_are_refused(tmp_path):
    # 40-pixel tiles: 5x5 patches, which 2x2 blocks do not cover (transformers fails too)
    llm = LLM(build_tiny_idefics3(str(tmp_path), tile=40), dtype="float32")
    with pytest.raises(ValueError, match="40x40 tiles: .* scale_factor 2 divides"):
        llm.generate(request("w60 <image>", [random_image(6, WIDE)]), greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("template, reads_parts", [
    ("{% for m in messages %}{% for line in m['content'] %}{% if line['type'] == 'image' %}"
     "<image>{% endif %}{% endfor %}{% endfor %}", True),  # Idefics3's, SmolVLM's
    ("{% for m in messages %}{% for c in m.content | selectattr('type', 'equalto', 'image') %}"
     "<image>\n{% endfor %}{% endfor %}", True),  # LLaVA's
    ("{% for m in messages %}{{ m['content'] }} {% endfor %}", False),
    ("{% for m in messages %}{% for x in m['tool_calls'] %}{% endfor %}{% endfor %}", False),
], ids=["idefics3", "llava", "string", "tool-calls"])
def test_templates_that_read_content_parts_are_found(template, reads_parts):
    assert template_reads_parts(template) is reads_parts


def test_preempted_requests_encode_again_and_match_transformers(idefics3_path):
    model = reference(idefics3_path)
    # 6 blocks of 8 tokens: two 25-token prompts growing to 41 tokens cannot both stay
    small = LLM(idefics3_path, dtype="float32", block_size=8, kv_cache_memory="24KiB",
                max_num_batched_tokens=16, max_num_encoder_input_tokens=24,
                encoder_cache_size=24, enable_prefix_caching=False)
    prompts = ["w5 w6 <image> w7 w8", "w9 w8 <image> w7 w6"]
    images = [random_image(400, WIDE), random_image(401, WIDE)]
    outs = small.generate([request(p, [i]) for p, i in zip(prompts, images)], greedy(16),
                          use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for prompt, image, out in zip(prompts, images, outs):
        assert out.outputs[0].token_ids == hf_generate(model, prompt, [image], 16)[0]

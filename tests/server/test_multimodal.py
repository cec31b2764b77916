"""Images through `runtime serve` on a tiny LLaVA: the official `openai` client (a data URL)
and `anthropic` client (a base64 block) against transformers' greedy reply, the Responses
API's `input_image`, and hostile image inputs, each a 400 (413 for size) naming what is
wrong, with no fetch made where none is allowed."""
from __future__ import annotations

import base64
import io

import anthropic
import httpx
import openai
import pytest
import torch

from runtime.testing.tiny_vlm import build_tiny_llava, random_image
from tests.server.conftest import API_KEY, TINY_ARGS, Server, wait_for

MAX_BODY = 2 * 2**20


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def server(llava, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    s = Server([llava, *TINY_ARGS, "--served-model-name", "tiny-vlm", "--api-key", API_KEY,
                "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path",
                str(media), "--max-request-body-bytes", str(MAX_BODY)],
               str(tmp_path_factory.mktemp("log") / "server.log"))
    s.media = media
    yield s
    s.stop()


@pytest.fixture(scope="module")
def image_bytes():
    return png(random_image(7))


def hf_reply(llava: str, image_data: bytes, text: str, n: int) -> str:
    """transformers' greedy reply to [image, text] rendered by the tiny chat template."""
    from PIL import Image
    from transformers import (AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration,
                              LlavaProcessor)
    tokenizer = AutoTokenizer.from_pretrained(llava)
    processor = LlavaProcessor(image_processor=AutoImageProcessor.from_pretrained(
        llava, backend="pil"), tokenizer=tokenizer, patch_size=8,
        vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1)
    inputs = processor(text=f"<image>\n{text} ", images=[Image.open(io.BytesIO(image_data))],
                       return_tensors="pt")
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_openai_and_anthropic_clients_match_transformers(server, llava, image_bytes):
    expected = hf_reply(llava, image_bytes, "w5 w6", 6)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    reply = client.chat.completions.create(model="tiny-vlm", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes)}},
        {"type": "text", "text": "w5 w6"}]}])
    # word-level detokenization may lead with a space: the words are what must agree
    assert reply.choices[0].message.content.split() == expected.split()
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    message = claude.messages.create(model="tiny-vlm", max_tokens=6,
                                     extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(image_bytes).decode()}},
        {"type": "text", "text": "w5 w6"}]}])
    assert message.content[0].text.split() == expected.split()
    response = httpx.post(server.url + "/v1/responses", headers=auth(), json={
        "model": "tiny-vlm", "max_output_tokens": 6, "temperature": 0, "input": [
            {"role": "user", "content": [
                {"type": "input_image", "image_url": data_url(image_bytes)},
                {"type": "input_text", "text": "w5 w6"}]}]}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"].split() == expected.split()
    (server.media / "cat.png").write_bytes(image_bytes)
    assert chat(server, [image_part(f"file://{server.media}/cat.png"), text("w5 w6")],
                6).json()["choices"][0]["message"]["content"].split() == expected.split()


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def chat(server, content: list, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", headers=auth(), timeout=60, json={
        "model": "tiny-vlm", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": content}]})


def bomb() -> bytes:
    """A PNG of 9000 x 8000 one-bit pixels: a few kB that would decode to 72 Mpx."""
    from PIL import Image
    return png(Image.new("1", (9000, 8000)))


HOSTILE = {
    "invalid base64": ([image_part("data:image/png;base64,@@@not-base64@@@")], 400,
                       "not valid base64"),
    "not an image": ([image_part(data_url(b"plain text, not pixels"))], 400,
                     "cannot be decoded"),
    "truncated": (None, 400, "cannot be decoded"),
    "decompression bomb": ([image_part(data_url(bomb()))], 413, "9000x8000 pixels"),
    "too many images": (None, 400, "more than the 2 allowed"),
    "disallowed host": ([image_part("http://169.254.169.254/latest/cat.png")], 400,
                        "--allowed-media-domains"),
    "file outside the folder": ([image_part("file:///etc/passwd")], 400,
                                "outside --allowed-local-media-path"),
    "audio part": ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                   400, "'input_audio' content part"),
    "empty image part": ([{"type": "image_url", "image_url": {}}], 400, "has no image"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_images_are_refused_naming_the_part(server, image_bytes, case):
    content, status, words = HOSTILE[case]
    if case == "truncated":
        content = [image_part(data_url(image_bytes[:len(image_bytes) // 2]))]
    elif case == "too many images":
        content = [image_part(data_url(image_bytes))] * 3
    response = chat(server, [*content, text("w5")])
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_an_oversized_body_is_413_and_the_server_goes_on(server, image_bytes):
    huge = data_url(b"\0" * MAX_BODY)
    assert chat(server, [image_part(huge), text("w5")]).status_code == 413
    assert chat(server, [image_part(data_url(image_bytes)), text("w5")]).status_code == 200


def test_an_image_on_a_text_only_model_is_400(tiny_server, image_bytes):
    response = httpx.post(tiny_server.url + "/v1/chat/completions", headers=auth(), json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            image_part(data_url(image_bytes)), text("hi")]}]}, timeout=60)
    assert response.status_code == 400
    assert "text-only" in response.json()["error"]["message"]


def test_a_repeated_image_is_an_encoder_cache_hit_on_metrics(server):
    image = data_url(png(random_image(8)))
    queries = server.metric("runtime:encoder_cache_queries_total")
    hits = server.metric("runtime:encoder_cache_hits_total")
    for words in ("w5", "w6 w7"):  # text first: no prefix-cache hit covers the image
        assert chat(server, [text(words + " "), image_part(image)]).status_code == 200
    assert wait_for(lambda: server.metric("runtime:encoder_cache_queries_total") - queries == 2)
    assert server.metric("runtime:encoder_cache_hits_total") - hits == 1  # one encoder run

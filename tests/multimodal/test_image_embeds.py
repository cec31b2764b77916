"""Images given as their embeddings (`enable_mm_embeds`) on tiny LLaVA and Qwen3-VL models:
embeddings computed by transformers' own encoder of the model give the same greedy tokens and
logprobs as the image itself (Qwen3-VL's with its DeepStack parts side by side, in vLLM's dict
form with `image_grid_thw`), split over prefill chunks, and hit the prefix cache by content;
the OpenAI chat `image_embeds` part (base64 of a torch.save()d tensor) through the `openai`
client; and every malformed input refused with an error naming it, the engine serving on."""
from __future__ import annotations

import asyncio
import base64
import io
import pickle

import httpx
import numpy as np
import openai
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.testing.tiny_vlm import QWEN_VL_IMAGE, build_tiny_llava, build_tiny_qwen_vl
from runtime.testing.tiny_vlm import random_image
from runtime.config import EngineConfig
from runtime.engine.async_llm import AsyncLLM
from runtime.entrypoints.server import CORS, create_app
from runtime.metrics import Metrics

LOGPROB_TOL = 1e-4  # the same embeddings in float32 on both paths
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)


def encode(obj) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def assert_same(a, b) -> None:
    a, b = a.outputs[0], b.outputs[0]
    assert a.token_ids == b.token_ids
    gap = max(abs(x[t].logprob - y[t].logprob)
              for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
    assert gap < LOGPROB_TOL


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def llava(llava_path):
    return LLM(llava_path, dtype="float32", enable_mm_embeds=True, max_num_batched_tokens=8,
               block_size=8, max_num_encoder_input_tokens=32, encoder_cache_size=64)


def llava_embeds(path: str, images: list) -> list[torch.Tensor]:
    """transformers' LLaVA image features (tower, feature layer, projector) of `images`."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pixels = AutoImageProcessor.from_pretrained(path, backend="pil")(
        images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return list(model.model.get_image_features(pixel_values=pixels).pooler_output)


def test_llava_embeddings_give_the_image_s_tokens_and_logprobs(llava, llava_path):
    images = [random_image(1), random_image(2)]
    embeds = llava_embeds(llava_path, images)
    prompt = "w12 <image> w13 <image> w14"
    kv = llava.engine.core.kv
    by_image, by_embeds, by_batch = llava.generate(
        [{"prompt": prompt, "multi_modal_data": {"image": images}},
         {"prompt": prompt, "multi_modal_data": {"image": embeds}},
         {"prompt": prompt, "multi_modal_data": {"image": torch.stack(embeds)}}],
        GREEDY, use_tqdm=False)
    assert_same(by_embeds, by_image)
    assert_same(by_batch, by_image)
    hits = kv.num_cache_hits
    again = llava.generate({"prompt": prompt, "multi_modal_data": {"image": embeds[:1] * 2}},
                           GREEDY, use_tqdm=False)[0]
    assert kv.num_cache_hits - hits == 16  # the first image's blocks, never the second's
    assert_same(again, llava.generate(
        {"prompt": prompt, "multi_modal_data": {"image": images[:1] * 2}}, GREEDY,
        use_tqdm=False)[0])
    _, _, features = llava.engine.processor.prepare(
        {"prompt": prompt, "multi_modal_data": {"image": [embeds[0], embeds[0].clone()]}})
    assert features[0].identifier == features[1].identifier  # keyed by content


@pytest.mark.parametrize("item, error", [
    (np.zeros((16, 64), np.float32), "must be a PIL image, bytes or a URL string"),
    (torch.zeros(16, 32), "rows must be 64 wide"),
    (torch.zeros(16, 64, dtype=torch.int64), "must be float32, bfloat16 or float16"),
    (torch.full((16, 64), float("nan")), "not finite"),
    (torch.zeros(65, 64), "65 embedding tokens, more than the encoder's budget"),
    (torch.zeros(0, 64), "is empty"),
    ({"image_embeds": torch.zeros(16, 64), "image_grid_thw": torch.tensor([1, 8, 8])},
     "'image_grid_thw', which this model does not take"),
    ({"image_embeds": 3}, "must be a torch.Tensor"),
])
def test_malformed_embeddings_are_refused_naming_the_image(llava, item, error):
    with pytest.raises(ValueError, match=error) as info:
        llava.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": item}}, GREEDY,
                       use_tqdm=False)
    assert str(info.value).startswith("image 0")


def test_embeddings_need_the_flag(llava_path):
    off = LLM(llava_path, dtype="float32", kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match=r"start it with enable_mm_embeds=True"):
        off.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": torch.zeros(16, 64)}},
                     GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def qwen3_vl_path(tmp_path_factory):
    return build_tiny_qwen_vl(str(tmp_path_factory.mktemp("qwen3_vl")), "3")


def qwen3_vl_embeds(path: str, images: list) -> list[dict[str, torch.Tensor]]:
    """transformers' Qwen3-VL image features, [main | DeepStack] per row, and their grids."""
    from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    out = AutoImageProcessor.from_pretrained(path, backend="pil")(images=images,
                                                                  return_tensors="pt")
    with torch.no_grad():
        features = model.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
    rows = [torch.cat(parts, -1) for parts in zip(features.pooler_output,
                                                    *features.deepstack_features)]
    return [{"image_embeds": r, "image_grid_thw": g} for r, g in zip(rows, out["image_grid_thw"])]


def test_qwen3_vl_embeddings_with_their_grid_give_the_image_s_tokens(qwen3_vl_path):
    llm = LLM(qwen3_vl_path, dtype="float32", enable_mm_embeds=True, max_num_batched_tokens=8,
              max_num_encoder_input_tokens=32, encoder_cache_size=64)
    images = [random_image(2, (112, 84)), random_image(3, (56, 56))]  # 12 and 4 tokens
    items = qwen3_vl_embeds(qwen3_vl_path, images)
    prompt = f"w20 {QWEN_VL_IMAGE} w21 {QWEN_VL_IMAGE} w22"
    by_image, by_embeds = llm.generate(
        [{"prompt": prompt, "multi_modal_data": {"image": images}},
         {"prompt": prompt, "multi_modal_data": {"image": items}}], GREEDY, use_tqdm=False)
    assert_same(by_embeds, by_image)
    # a chat part in the server's form: the dict of base64 tensors
    encoded = {name: encode(t) for name, t in items[1].items()}
    replies = [llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "w5"}]}],
                        GREEDY, use_tqdm=False)[0]
               for part in ({"type": "image_pil", "image_pil": images[1]},
                            {"type": "image_embeds", "image_embeds": encoded})]
    assert_same(*replies)
    for item, error in [(items[0]["image_embeds"], "need their 'image_grid_thw'"),
                        ({**items[0], "image_grid_thw": torch.tensor([1, 4, 4])},
                         "12 rows, but their image_grid_thw"),
                        ({**items[0], "image_grid_thw": torch.tensor([1.0, 6, 8])},
                         "must be 3 integers")]:
        with pytest.raises(ValueError, match=error):
            llm.generate({"prompt": f"w5 {QWEN_VL_IMAGE}", "multi_modal_data": {"image": item}},
                         GREEDY, use_tqdm=False)


class Evil:
    """A pickle that runs code when loaded unsafely: weights_only refuses it."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('code ran')",))


def test_chat_image_embeds_part_through_the_openai_client(llava_path):
    """The server's app in-process, the `openai` client on it through an ASGI transport."""
    image = random_image(5)
    [embeds] = llava_embeds(llava_path, [image])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    refused = [("%%%", "image_embeds must be base64 of a torch.save()d tensor"),
               (base64.b64encode(pickle.dumps(Evil(), protocol=2)).decode(), "torch.save()d tensor"),
               (encode({"a": torch.zeros(2)}), "image_embeds must hold a tensor, got dict"),
               (encode(torch.zeros(16, 8)), "rows must be 64 wide"),
               (encode(torch.zeros(40, 64)), "more than the encoder's budget")]

    async def serve() -> None:
        engine = AsyncLLM(EngineConfig(model=llava_path, dtype="float32", num_threads=1,
                                       kv_cache_memory="1MiB", enable_mm_embeds=True,
                                       max_num_batched_tokens=32))
        await engine.start()
        app = create_app(engine, Metrics("vlm"), ["vlm"], None, None, "v1", 1 << 20,
                         CORS([], [], []), False)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", max_retries=0,
                                    http_client=http)

        async def chat(part: dict) -> str:
            reply = await client.chat.completions.create(
                model="vlm", max_tokens=5, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [part, {"type": "text", "text": "w5"}]}])
            return reply.choices[0].message.content

        try:
            by_image = await chat({"type": "image_url", "image_url": {"url": url}})
            part = {"type": "image_embeds", "image_embeds": encode(embeds)}
            assert await chat(part) == by_image
            for value, error in refused:
                with pytest.raises(openai.BadRequestError, match="image 0") as info:
                    await chat({"type": "image_embeds", "image_embeds": value})
                assert error in str(info.value)
            assert await chat(part) == by_image  # the engine serves on
        finally:
            await http.aclose()
            await engine.shutdown()

    asyncio.run(serve())

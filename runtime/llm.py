"""`LLM`: the offline API, the same on every device."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from runtime.beam_search import BeamSearch, BeamSearchGroup, BeamSearchOutput, BeamSearchParams
from runtime.config import EngineConfig
from runtime.engine.core import EngineCore
from runtime.engine.input_processor import PromptType
from runtime.engine.llm_engine import LLMEngine
from runtime.lora.request import LoRARequest
from runtime.outputs import RequestOutput
from runtime.pooling import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams,
                             PoolingRequestOutput, ScoringRequestOutput)
from runtime.engine.pooling_engine import PoolingEngine
from runtime.model_spec import ModelSpec
from runtime.multimodal.chat_parts import ChatImages
from runtime.pooling.processor import PromptInput, params_list, prompt_list
from runtime.progress import GenerateProgress
from runtime.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """Generate text with a model on whatever device the platform plugins find.

    `model` is a Hugging Face folder, a .gguf file, or None for the embedded default
    (SmolLM2-135M-Instruct). `config` is a YAML file of `EngineConfig` fields (as `runtime tune`
    writes); every other keyword is an `EngineConfig` field and wins over the file.
    `runner="pooling"` (auto-detected for sentence-transformers folders, encoders and
    `*ForSequenceClassification`) serves `embed`, `classify`, `score` and `encode` instead.
    """

    def __init__(self, model: str | None = None, config: str | None = None,
                 **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        if config is None:
            kwargs.setdefault("disable_log_stats", True)  # as vLLM's LLM: no periodic stats
        engine_config = (EngineConfig.from_yaml(config, **kwargs) if config is not None
                         else EngineConfig.from_kwargs(**kwargs))
        spec = ModelSpec.resolve(engine_config)
        self.pooling = PoolingEngine(engine_config, spec) if spec.pools else None
        self.engine = None if spec.pools else LLMEngine(engine_config, spec)
        self.tokenizer = (self.pooling or self.engine).tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a batch; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids", and "multi_modal_data" ({"image": a PIL image or a list}) for a
        vision-language model, its prompt holding one placeholder per image (with
        `enable_mm_embeds=True`, an image may be its embeddings: runtime.multimodal.embeds); with
        `enable_prompt_embeds=True`, {"prompt_embeds": tensor} ([tokens, hidden size], as
        transformers' `inputs_embeds`). `sampling_params` is one for all or one per prompt, and so is
        `lora_request` (None: the base model). Every prompt is validated before any is queued,
        so a bad one raises without starting the others.
        """
        self._generating("generate")
        if self.engine.core.asleep:
            raise RuntimeError("the engine is asleep: call wake_up() first")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else \
            [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        engine = self.engine
        tokenized = []
        for prompt, p, lora in zip(prompts, params, loras):
            text, ids, mm_features = engine.processor.prepare(prompt)
            engine.inputs.validate(ids, p)
            if lora is not None:
                engine.processor.check_lora(lora)
            tokenized.append({"prompt": text, "prompt_token_ids": ids,
                              "mm_features": mm_features,
                              "prompt_embeds": engine.processor.prompt_embeds(prompt, p)})
        order = {engine.add_request(prompt, p, priority=prio, lora_request=lora): i
                 for i, (prompt, p, prio, lora) in
                 enumerate(zip(tokenized, params, priorities, loras))}
        return self._run(order, use_tqdm)

    def get_tokenizer(self):
        """The tokenizer prompts are encoded with (vLLM's `LLM.get_tokenizer`)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` uses: the model's generation config defaults
        (`generation_config="auto"`), else SamplingParams' own."""
        return self.engine.processor.default_sampling_params()

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt (as transformers' `num_beams`); the best sequences
        first. Each step runs every live beam of every prompt as a one-token request; the
        prefix cache lets the beams share their common blocks."""
        self._generating("beam_search")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        inputs = self.engine.inputs
        searches = []
        for prompt in prompts:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                raise ValueError("beam_search does not take multi_modal_data yet: use "
                                 "generate with images")
            _, ids = inputs.tokenize(prompt)
            inputs.validate(ids, SamplingParams())
            room = inputs.max_tokens(ids, SamplingParams(max_tokens=params.max_tokens))
            limited = dataclasses.replace(params, max_tokens=room)
            searches.append(BeamSearch(ids, limited, inputs.eos_token_ids))
        group = BeamSearchGroup(searches)
        while not group.done:
            beams = [{"prompt_token_ids": seq} for seq in group.pending()]
            group.advance(self.generate(beams, group.step_params(), use_tqdm=False))
        results = [s.output() for s in searches]
        for result in results:
            for seq in result.sequences:
                seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return results

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the tokenizer's chat template.

        A message's content is a string or a list of parts: text, and for a vision-language
        model images (`{"type": "image_url", "image_url": {"url": ...}}` with a data:,
        http(s):// or file:// URL, or `{"type": "image_pil", "image_pil": image}`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            images = self._chat_images(chat_template)
            conversation = [{**m, "content": images.content_of(m["content"], _text_parts)}
                            if isinstance(m.get("content"), (list, str)) else m
                            for m in conversation]
            text = self._chat_text(conversation, chat_template, add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append(images.prompt({"prompt": text, "prompt_token_ids": ids}))
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_images(self, chat_template: str | None) -> ChatImages:
        multimodal = self.engine.processor.multimodal
        if multimodal is None:
            return ChatImages(None)
        return ChatImages(multimodal.placeholder, multimodal.chat_parts(chat_template))

    def apply_chat_template(self, messages: Messages, chat_template: str | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        text = self._chat_text(messages, chat_template, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _chat_text(self, messages: Messages, chat_template: str | None,
                   add_generation_prompt: bool) -> str:
        """The conversation rendered by the chat template: the prompt `chat` reports."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template")
        return self.tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                                  add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    @property
    def _core(self) -> EngineCore:
        return (self.engine or self.pooling).core

    def sleep(self, level: int = 1) -> None:
        """Free memory until `wake_up`: the KV cache (level 1), and the weights too (level 2,
        read again from the model's files on wake-up). Needs `enable_sleep_mode=True`; the
        prefix cache is dropped. Nothing can run while asleep."""
        self._core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep freed: `tags` "weights" and/or "kv_cache" (default both)."""
        self._core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self._core.asleep)

    def update_weights(self, model_path: str) -> None:
        """Serve the weights of `model_path` (a folder or .gguf file of the same architecture
        and config) from now on, without a restart; the tokenizer stays the first model's and
        the prefix cache is dropped. A checkpoint that cannot be loaded raises ValueError and
        leaves the old weights served."""
        self._core.update_weights(model_path)

    def _generating(self, method: str) -> None:
        if self.engine is None:
            raise ValueError(f"LLM.{method} needs a generation model; this one pools "
                             f"(runner='pooling'): use embed, classify, score or encode")

    def _pooling_engine(self, method: str) -> PoolingEngine:
        if self.pooling is None:
            raise ValueError(f"LLM.{method} needs a pooling model (runner='pooling'); this one "
                             f"generates")
        return self.pooling

    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (pooled as the model's sentence-transformers config says,
        `dimensions` and normalisation from the params)."""
        prompts = prompt_list(prompts)
        return self._pooling_engine("embed").embed(
            prompts, params_list(pooling_params, len(prompts), truncate_prompt_tokens))

    def classify(self, prompts: PromptInput | Sequence[PromptInput],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Label probabilities per prompt from a `*ForSequenceClassification` model."""
        prompts = prompt_list(prompts)
        return self._pooling_engine("classify").classify(
            prompts, params_list(pooling_params, len(prompts), truncate_prompt_tokens))

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Scores of text pairs: one `data_1` against each of `data_2`, or pairwise for lists of
        one length. A cross-encoder scores each pair; an embedding model gives the cosine
        similarity of the two embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(f"score takes one text and a list, or two lists of one length; "
                             f"got {len(first)} and {len(second)}")
        params = params_list(pooling_params, 1, truncate_prompt_tokens)[0]
        return self._pooling_engine("score").score(first, second, params)

    def encode(self, prompts: PromptInput | Sequence[PromptInput],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str = "embed") -> list[PoolingRequestOutput]:
        """The raw pooled tensors: `pooling_task` "embed" (the embedding), "classify" (the
        label logits) or "token_embed" (every token's hidden state)."""
        prompts = prompt_list(prompts)
        return self._pooling_engine("encode").encode(
            prompts, params_list(pooling_params, len(prompts), truncate_prompt_tokens),
            pooling_task)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        with GenerateProgress(len(order), enabled=use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id in order:
                        progress.update(output)
                        if output.finished:
                            results[order[output.request_id]] = output
        return results


def _text_parts(parts: list) -> str:
    """The text of text content parts (`LLM.chat`)."""
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or \
                not isinstance(part.get("text"), str):
            raise ValueError(f"a content part must be a text or an image part, got {part!r:.80}")
        texts.append(part["text"])
    return "".join(texts)

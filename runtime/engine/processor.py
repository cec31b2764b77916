"""Request processing around an engine core, shared by the sync `LLMEngine` and `AsyncLLM`.

In: a prompt and its sampling params become validated core `Request`s (one per sample).
Out: the core's token outputs become `RequestOutput`s (text, logprobs, finish reasons), and the
samples whose text hit a stop string, which the caller must finish in the core.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

from runtime.config import EngineConfig
from runtime.engine.core import CoreOutput
from runtime.engine.input_processor import InputProcessor, PromptType, eos_token_ids
from runtime.engine.output_processor import OutputKind, OutputProcessor
from runtime.engine.prompt_embeds import FLAG, PLACEHOLDER_TOKEN_ID, check_prompt_embeds
from runtime.generation_config import generation_defaults
from runtime.kv_transfer.registry import check_kv_transfer_params
from runtime.model_loader.source import ModelSource, load_tokenizer
from runtime.outputs import RequestOutput
from runtime.lora.adapter import check_files, load_adapter
from runtime.lora.request import LoRARequest
from runtime.multimodal.inputs import MultiModalFeature, TensorData
from runtime.multimodal.processing import build_multimodal_processor
from runtime.request import Request
from runtime.sampling_params import SamplingParams


class Processor:
    """Tokenizes and validates requests going in, detokenizes outputs coming back."""

    def __init__(self, config: EngineConfig, source: ModelSource, hf_config: Any,
                 max_model_len: int) -> None:
        self.tokenizer = load_tokenizer(source, config.trust_remote_code)
        self.inputs = InputProcessor(self.tokenizer, hf_config.get_text_config().vocab_size,
                                     max_model_len,
                                     eos_token_ids(source, hf_config, self.tokenizer),
                                     config.max_logprobs,
                                     config.structured_outputs_config.resolved_backend)
        # --generation-config: SamplingParams fields a request that leaves them out gets
        self.sampling_defaults = generation_defaults(config.generation_config, source)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.config = config
        self.hf_config = hf_config
        self.checked_loras: set[LoRARequest] = set()  # adapters found runnable
        self.multimodal = build_multimodal_processor(config, source, hf_config, self.tokenizer)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    output_kind: OutputKind = OutputKind.CUMULATIVE,
                    lora_request: LoRARequest | None = None) -> list[Request]:
        """Validate one prompt and register it; returns the core requests to queue (one per
        sample). Raises ValueError, registering nothing, on bad input."""
        if lora_request is not None:
            self.check_lora(lora_request)
        params = params or self.default_sampling_params()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids, mm_features = self.prepare(prompt)
        embeds = self.prompt_embeds(prompt, params)
        params = self.inputs.validate(token_ids, params)
        check_kv_transfer_params(self.config.kv_transfer_config, params.extra_args)
        max_tokens = self.inputs.max_tokens(token_ids, params)
        arrival = time.monotonic()
        num_samples = params.num_samples
        if num_samples > params.n and output_kind == OutputKind.DELTA:
            raise ValueError(f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: "
                             "the best samples are known only at the end")
        sample_ids = [request_id] if num_samples == 1 else \
            [f"{request_id}#{k}" for k in range(num_samples)]
        # an embeddings prompt reports no token ids (its ids are placeholders)
        self.outputs.add_request(request_id, text, [] if embeds is not None else token_ids,
                                 params, sample_ids, arrival, output_kind, len(token_ids))
        if num_samples > params.n and params.logprobs is None:
            params = params.clone(logprobs=0)  # the ranking needs each token's logprob
        return [Request(sample_id, token_ids, params, max_tokens, priority, arrival,
                        parent_id=request_id, sample_index=k,
                        leader_id=sample_ids[0] if k else None, lora_request=lora_request,
                        mm_features=mm_features, prompt_embeds=embeds)
                for k, sample_id in enumerate(sample_ids)]

    def prepare(self, prompt: PromptType) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """The prompt's text, its token ids (image placeholders expanded) and its images.

        A dict prompt may hold "multi_modal_data" ({"image": image or list}), or the
        "mm_features" an earlier `prepare` made of it. A {"prompt_embeds": tensor} prompt
        (`prompt_embeds`) has one placeholder token per row."""
        embeds = self.prompt_embeds(prompt)
        if embeds is not None and "prompt_token_ids" not in prompt:
            return None, [PLACEHOLDER_TOKEN_ID] * embeds.shape[0], []
        text, token_ids = self.inputs.tokenize(prompt)
        if not isinstance(prompt, dict):
            return text, token_ids, []
        if "mm_features" in prompt:
            return text, token_ids, list(prompt["mm_features"])
        mm_data = prompt.get("multi_modal_data")
        if mm_data is None:
            return text, token_ids, []
        if self.multimodal is None:
            raise ValueError(f"multi_modal_data was given ({', '.join(map(repr, mm_data))}), "
                             f"but {self.hf_config.architectures[0]} is a text-only model")
        token_ids, features = self.multimodal.process(token_ids, mm_data)
        most = min(self.config.max_num_encoder_input_tokens, self.config.encoder_cache_size)
        for k, feature in enumerate(features):
            if feature.length > most:
                raise ValueError(f"{feature.modality} {k} takes {feature.length} embedding "
                                 f"tokens, more than the encoder's budget or cache holds "
                                 f"({most}): raise --max-num-encoder-input-tokens and "
                                 "--encoder-cache-size")
        total = sum(f.length for f in features)
        if not self.config.enable_chunked_prefill and total > most:
            raise ValueError(f"the prompt's images take {total} embedding tokens, more than "
                             f"one step's encoder budget or cache ({most}), which without "
                             "chunked prefill must hold them all")
        return text, token_ids, features

    def prompt_embeds(self, prompt: PromptType, params: SamplingParams | None = None
                      ) -> TensorData | None:
        """A {"prompt_embeds": tensor} prompt's embeddings, checked against the model (what
        an earlier call made of them is taken as it is); None for any other prompt. Raises
        ValueError when the engine takes no prompt embeddings, the tensor does not fit, or
        `params` ask for what such a prompt cannot give."""
        embeds = prompt.get("prompt_embeds") if isinstance(prompt, dict) else None
        if embeds is None:
            return None
        if params is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported for a prompt given as "
                             "prompt_embeds: it has no token ids to score")
        if isinstance(embeds, TensorData):
            return embeds
        if not self.config.enable_prompt_embeds:
            raise ValueError(f"prompt_embeds were given, but this engine takes none: start it "
                             f"with {FLAG}")
        if "multi_modal_data" in prompt:
            raise ValueError("prompt_embeds cannot come with multi_modal_data: embed the "
                             "images into the prompt embeddings")
        return check_prompt_embeds(embeds, self.hf_config.get_text_config().hidden_size,
                                   self.inputs.max_model_len)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raise ValueError if the engine cannot run this adapter (LoRA off, or the folder is
        missing, of too high a rank, for modules or shapes this model lacks)."""
        if lora_request in self.checked_loras:
            check_files(lora_request)  # its folder may have gone since
            return
        if not self.config.enable_lora:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is "
                             "off: start the engine with enable_lora=True (--enable-lora)")
        load_adapter(lora_request, self.hf_config, self.config.max_lora_rank)
        self.checked_loras.add(lora_request)

    def default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params gets: the --generation-config defaults."""
        return SamplingParams(**self.sampling_defaults)

    def abort_request(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """Forget a request; returns the core ids of its samples (the caller finishes them in
        the core) and its final output, or ([], None) for an unknown or finished request."""
        state = self.outputs.requests.get(request_id)
        if state is None:
            return [], None
        return list(state.samples), self.outputs.abort(request_id)

    def process_outputs(self, outputs: list[CoreOutput]
                        ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """One step's core outputs -> request outputs, and (core id, stop string) pairs."""
        return self.outputs.process(outputs)

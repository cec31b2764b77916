"""`LLM`: the offline API, the same on every device."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from runtime.beam_search import BeamSearch, BeamSearchGroup, BeamSearchOutput, BeamSearchParams
from runtime.config import EngineConfig
from runtime.engine.input_processor import PromptType
from runtime.engine.llm_engine import LLMEngine
from runtime.outputs import RequestOutput
from runtime.progress import GenerateProgress
from runtime.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """Generate text with a model on whatever device the platform plugins find.

    `model` is a Hugging Face folder, a .gguf file, or None for the embedded default
    (SmolLM2-135M-Instruct). `config` is a YAML file of `EngineConfig` fields (as `runtime tune`
    writes); every other keyword is an `EngineConfig` field and wins over the file.
    """

    def __init__(self, model: str | None = None, config: str | None = None,
                 **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        if config is None:
            kwargs.setdefault("disable_log_stats", True)  # as vLLM's LLM: no periodic stats
        engine_config = (EngineConfig.from_yaml(config, **kwargs) if config is not None
                         else EngineConfig.from_kwargs(**kwargs))
        self.engine = LLMEngine(engine_config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids". `sampling_params` is one for all or one per prompt. Every prompt is
        validated before any is queued, so a bad one raises without starting the others.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        engine = self.engine
        tokenized = []
        for prompt, p in zip(prompts, params):
            text, ids = engine.inputs.tokenize(prompt)
            engine.inputs.validate(ids, p)
            tokenized.append({"prompt": text, "prompt_token_ids": ids})
        order = {engine.add_request(prompt, p, priority=prio): i
                 for i, (prompt, p, prio) in enumerate(zip(tokenized, params, priorities))}
        return self._run(order, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` uses: the model's generation config defaults
        (`generation_config="auto"`), else SamplingParams' own."""
        return self.engine.processor.default_sampling_params()

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt (as transformers' `num_beams`); the best sequences
        first. Each step runs every live beam of every prompt as a one-token request; the
        prefix cache lets the beams share their common blocks."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        inputs = self.engine.inputs
        searches = []
        for prompt in prompts:
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
        """Generate replies to conversations, rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, chat_template,
                                                                 add_generation_prompt),
                    "prompt": None} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: Messages, chat_template: str | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template")
        text = self.tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                                  add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

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

"""Turns what the user passed into token ids, and checks it against the model's limits."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.model_loader.source import ModelSource

# A prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids} (or, through
# `Processor`, {"prompt_embeds": tensor}).
PromptType = Union[str, list[int], dict]


def eos_token_ids(source: ModelSource, hf_config: Any, tokenizer: Any) -> list[int]:
    """The tokens that end generation, as `transformers` `generate` would use them."""
    ids = None
    if source.format == "hf":
        try:
            from transformers import GenerationConfig
            ids = GenerationConfig.from_pretrained(source.path).eos_token_id
        except OSError:
            ids = None
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 eos_token_ids: list[int], max_logprobs: int = 20,
                 structured_outputs_backend: str = "xgrammar") -> None:
        self.tokenizer = tokenizer
        self.structured_outputs_backend = structured_outputs_backend
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt_embeds" in prompt:
                raise ValueError("prompt_embeds are taken by generate() and /v1/completions "
                                 "only (not by beam search or pooling)")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, "
                         f"got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check the prompt against the model; returns the params the engine will use."""
        if not token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), "
                             f"got {bad[:5]}")
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size}), "
                                 f"got {bad[:5]}")
        if params.structured_outputs is not None:
            from runtime.structured_output.backends import check
            # raises ValueError naming what is wrong
            check(params.structured_outputs, self.structured_outputs_backend)
        if params.bad_words and params._bad_words_token_ids is None:
            params = params.clone(_bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens long, but the model's "
                             f"context (max_model_len) is {self.max_model_len} tokens, which "
                             "must hold the prompt and at least one generated token")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"{name} asks for {asked} logprobs, but this engine returns "
                                 f"at most {self.max_logprobs} (--max-logprobs)")
        primary = self.eos_token_ids[0] if self.eos_token_ids else None
        extra = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            params = params.clone(stop_token_ids=list(params.stop_token_ids) + extra)
        return params.with_eos(primary)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens, alone and after a space (the two ways it occurs in text)."""
        variants = {tuple(self.tokenizer.encode(text, add_special_tokens=False))
                    for word in words for text in (word.strip(), " " + word.strip())}
        return [list(ids) for ids in sorted(variants) if ids]

    def max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        room = self.max_model_len - len(token_ids)
        return room if params.max_tokens is None else min(params.max_tokens, room)

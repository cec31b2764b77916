"""Incremental detokenization of one sample, with stop strings and streaming deltas."""
from __future__ import annotations

from typing import Any

from runtime.sampling_params import SamplingParams

# Prompt tokens decoded in front of the output so that the first output token is decoded in
# context (a SentencePiece "▁word" at the start of a text loses its space; after a prompt it
# keeps it).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns the output tokens of one sample into text as they arrive.

    Each step decodes a short window of tokens: `_prefix:_read` was already emitted (it gives
    the new tokens their context), `_read:` is new. Text is emitted only when the window's
    decoding grows and does not end in U+FFFD, so a UTF-8 character split across byte-level
    tokens is held back until it is complete. After `finish()` the text equals decoding the
    whole output at once (in the prompt's context, for tokenizers that strip a leading space).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.num_output_tokens = 0
        self.finished = False
        self._stop = params.stop
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # Streaming holds back text that a later stop-string match could still cut off.
        self._hold = 0 if params.include_stop_str_in_output else max(self._max_stop_len - 1, 0)
        self._sent = 0
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add this step's tokens; return the stop string that ended the text, else None.

        On a stop string `output_text` is cut before it (or after it with
        include_stop_str_in_output) and the detokenizer is finished. `stop_terminated` says the
        last token is a stop token (eos or stop_token_ids) that ends the request: its text is
        left out unless include_stop_str_in_output, and the detokenizer is finished.
        """
        self.num_output_tokens += len(new_token_ids)
        if not self.params.detokenize or self.finished:
            return None
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        checked = len(self.output_text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._emit(final=False)
        stop = self._check_stop(checked)
        if stop is not None:
            self.finished = True  # nothing after the stop string may be released
        elif stop_terminated:
            self.finish()
        return stop

    def finish(self) -> None:
        """Mark the text complete: release what was held back (an unfinished UTF-8 character
        at the very end, the stop-string lookahead) to `output_text` and `text_delta`."""
        if not self.finished and self.params.detokenize:
            self._emit(final=True)
        self.finished = True

    def text_delta(self) -> str:
        """The text added since the previous call, for streaming.

        Until the detokenizer is finished, the last (longest stop string - 1) characters are
        held back, since a stop string completed by a later token would remove them.
        """
        end = len(self.output_text)
        if not self.finished:
            end = max(end - self._hold, self._sent)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False)

    def _emit(self, final: bool) -> None:
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(self._prefix_text):
            return
        if text.endswith(REPLACEMENT_CHAR) and not final:
            return
        self.output_text += text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])

    def _check_stop(self, checked: int) -> str | None:
        # Like vLLM, stop strings count only once more than min_tokens tokens were generated.
        if not self._stop or self.num_output_tokens <= self.params.min_tokens:
            return None
        start = max(checked - self._max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        if self.params.include_stop_str_in_output:
            index += len(stop)
        self.output_text = self.output_text[:index]
        return stop


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own (for `Logprob.decoded_token`); special tokens included."""
    return tokenizer.decode([token_id], skip_special_tokens=False)

"""Turns the core's token outputs into user-facing results: text, logprobs, finish reasons."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.detokenizer import IncrementalDetokenizer, decode_token
from runtime.engine.core import CoreOutput
from runtime.outputs import (CompletionOutput, Logprob, PositionLogprobs, RequestMetrics,
                             RequestOutput)
from runtime.sampling_params import SamplingParams
from runtime.core.messages import TokenLogprobs


class OutputKind(enum.Enum):
    """What a request's outputs carry."""

    CUMULATIVE = "cumulative"  # every step: everything generated so far
    DELTA = "delta"  # every step: only what is new since the last output (for streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # tokens (and logprobs) already returned in DELTA outputs


@dataclass
class RequestState:
    """One user request; n > 1 samples run in the core as separate sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, SampleState]  # core request id -> sample
    prompt_logprobs: list[PositionLogprobs | None] | None
    metrics: RequestMetrics
    output_kind: OutputKind = OutputKind.CUMULATIVE
    kv_transfer_params: dict | None = None  # the KV connector's, once a sample finished

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.parent_of: dict[str, str] = {}  # core request id -> user request id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, sample_ids: list[str], arrival_time: float,
                    output_kind: OutputKind = OutputKind.CUMULATIVE,
                    num_prompt_tokens: int | None = None) -> None:
        """`num_prompt_tokens`: the prompt's length when it is not that of its token ids (a
        prompt of embeddings has none)."""
        samples = {}
        ranked = params.num_samples > params.n  # best_of: cumulative logprobs pick the best n
        for index, sample_id in enumerate(sample_ids):
            samples[sample_id] = SampleState(
                index, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None or ranked else None)
            self.parent_of[sample_id] = request_id
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] * len(prompt_token_ids)
        metrics = RequestMetrics(arrival_time=arrival_time,
                                 num_prompt_tokens=len(prompt_token_ids)
                                 if num_prompt_tokens is None else num_prompt_tokens,
                                 n=params.n,
                                 max_tokens=params.max_tokens)
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                                 samples, prompt_logprobs, metrics, output_kind)

    def _to_position(self, entry: TokenLogprobs) -> PositionLogprobs:
        position = {entry.ids[0]: Logprob(entry.logprobs[0], entry.rank,
                                          decode_token(self.tokenizer, entry.ids[0]))}
        for rank, (token_id, value) in enumerate(zip(entry.ids[1:], entry.logprobs[1:]), 1):
            if token_id not in position:
                position[token_id] = Logprob(value, rank, decode_token(self.tokenizer, token_id))
        return position

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Apply one step's outputs. Returns the updated requests' outputs, and the samples whose
        text hit a stop string (core id, stop string): the caller must finish them in the core.
        A FINAL_ONLY request appears only in the step it finishes; a DELTA request's output
        holds only the samples this step touched."""
        updated: dict[str, RequestState] = {}
        touched: dict[str, list[SampleState]] = {}
        stopped: list[tuple[str, str]] = []
        now = time.monotonic()
        for out in outputs:
            request_id = self.parent_of.get(out.request_id)
            if request_id is None:
                continue
            state = self.requests[request_id]
            sample = state.samples[out.request_id]
            updated[request_id] = state
            touched.setdefault(request_id, []).append(sample)
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                start, entries = out.prompt_logprobs
                for offset, entry in enumerate(entries):
                    state.prompt_logprobs[start + offset] = self._to_position(entry)
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if not out.new_token_ids and out.finish_reason is None:
                continue
            metrics = state.metrics
            if metrics.first_token_time is None and out.new_token_ids:
                metrics.first_token_time = now
                metrics.num_cached_tokens = out.num_cached_tokens
                metrics.first_scheduled_time = out.first_scheduled_time
            elif out.new_token_ids and metrics.last_token_time != now:  # once per step
                metrics.inter_token_latencies.append(now - metrics.last_token_time)
            if out.new_token_ids:
                metrics.last_token_time = now
            sample.token_ids.extend(out.new_token_ids)
            if out.logprobs and sample.cumulative_logprob is not None:
                for entry in out.logprobs[:len(out.new_token_ids)]:
                    if sample.logprobs is not None:
                        sample.logprobs.append(self._to_position(entry))
                    sample.cumulative_logprob += entry.logprobs[0]
            stop_token = out.finish_reason == "stop" and isinstance(out.stop_reason, int)
            stop_string = sample.detokenizer.update(out.new_token_ids, stop_terminated=stop_token)
            if stop_string is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop_string
                if out.finish_reason is None:
                    stopped.append((out.request_id, stop_string))
            elif out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                sample.detokenizer.finish()
            if sample.finish_reason is not None:
                del self.parent_of[out.request_id]
        results = []
        for state in updated.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            elif state.output_kind == OutputKind.FINAL_ONLY or \
                    state.params.num_samples > state.params.n:
                continue
            results.append(self._request_output(state, touched[state.request_id]))
        return results, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample of a user request aborted; returns its final output."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for sample_id, sample in state.samples.items():
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
                sample.detokenizer.finish()
            self.parent_of.pop(sample_id, None)
        return self._request_output(state)

    def _request_output(self, state: RequestState,
                        samples: list[SampleState] | None = None) -> RequestOutput:
        """The request's output; in DELTA mode only `samples` (default: all), each with what
        is new since its previous output."""
        if state.output_kind != OutputKind.DELTA:
            outputs = [CompletionOutput(index=s.index, text=s.detokenizer.output_text,
                                        token_ids=list(s.token_ids),
                                        cumulative_logprob=s.cumulative_logprob,
                                        logprobs=s.logprobs, finish_reason=s.finish_reason,
                                        stop_reason=s.stop_reason)
                       for s in state.samples.values()]
            if state.params.num_samples > state.params.n:  # best_of: the best n, re-indexed
                outputs.sort(key=lambda o: o.cumulative_logprob, reverse=True)
                outputs = outputs[:state.params.n]
                for index, output in enumerate(outputs):
                    output.index = index
        else:
            outputs = [self._delta(s) for s in samples or state.samples.values()]
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=outputs,
                             finished=state.finished, prompt_logprobs=state.prompt_logprobs,
                             metrics=state.metrics,
                             num_cached_tokens=state.metrics.num_cached_tokens,
                             kv_transfer_params=state.kv_transfer_params)

    @staticmethod
    def _delta(sample: SampleState) -> CompletionOutput:
        start, sample.num_sent_tokens = sample.num_sent_tokens, len(sample.token_ids)
        logprobs = sample.logprobs[start:] if sample.logprobs is not None else None
        return CompletionOutput(index=sample.index, text=sample.detokenizer.text_delta(),
                                token_ids=sample.token_ids[start:],
                                cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs,
                                finish_reason=sample.finish_reason,
                                stop_reason=sample.stop_reason)

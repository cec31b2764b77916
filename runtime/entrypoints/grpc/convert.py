"""VllmEngine messages to the engine's inputs, and its outputs back: SamplingParams with the
defaults vLLM's servicer gives proto3's zero values, and logprobs in smg's layout."""
from __future__ import annotations

from typing import Any

from runtime.entrypoints.grpc import vllm_engine_pb2 as pb
from runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.structured_output.params import StructuredOutputsParams

# GenerateRequest fields this server does not honour: set, they are refused
UNSERVED_REQUEST_FIELDS = {
    "kv_transfer_params": "KV transfer between prefill and decode workers",
    "kv_transfer_params_json": "KV transfer between prefill and decode workers",
    "mm_inputs": "multimodal inputs",
    "data_parallel_rank": "pinning a request to a data-parallel rank",
}
# the constraint oneof's members, by the StructuredOutputsParams field they fill
CONSTRAINTS = {"json_schema": "json", "regex": "regex", "grammar": "grammar",
               "structural_tag": "structural_tag", "json_object": "json_object",
               "choice": "choice"}


def unserved_field(request: pb.GenerateRequest) -> str | None:
    """The first field of `request` this server refuses, with why, if any."""
    for name, what in UNSERVED_REQUEST_FIELDS.items():
        if request.HasField(name):
            return f"{name} is not served: this server has no {what}"
    if request.sampling_params.HasField("truncate_prompt_tokens"):
        return ("sampling_params.truncate_prompt_tokens is not served: send the prompt's "
                "tokens as they should run")
    return None


def sampling_params(p: pb.SamplingParams, defaults: dict[str, Any]) -> SamplingParams:
    """The engine's SamplingParams; what the request leaves unset (proto3's zero, where zero
    is no valid choice) comes from `defaults` (the model's generation config, as on the HTTP
    routes), else SamplingParams' own. Raises ValueError for bad values."""
    constraint = p.WhichOneof("constraint")
    structured = None
    if constraint is not None:
        value: Any = getattr(p, constraint)
        if constraint == "choice":
            value = list(value.choices)
        structured = StructuredOutputsParams(**{CONSTRAINTS[constraint]: value})
    return SamplingParams(
        n=p.n or 1,
        temperature=p.temperature if p.HasField("temperature")
        else defaults.get("temperature", 1.0),
        top_p=p.top_p or defaults.get("top_p", 1.0),
        top_k=p.top_k or defaults.get("top_k", 0),
        min_p=p.min_p or defaults.get("min_p", 0.0),
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or defaults.get("repetition_penalty", 1.0),
        max_tokens=p.max_tokens if p.HasField("max_tokens") else defaults.get("max_tokens"),
        min_tokens=p.min_tokens,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        structured_outputs=structured,
        logit_bias=dict(p.logit_bias) or None,
        detokenize=bool(p.stop),  # token out: text only matters for stop strings
    )


def _top(position: PositionLogprobs, k: int) -> pb.TopLogProbs:
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in position.items()
                    if lp.rank is not None and 1 <= lp.rank <= k)
    return pb.TopLogProbs(values=[v for _, _, v in ranked], token_ids=[t for _, t, _ in ranked])


def output_logprobs(sample: CompletionOutput, k: int) -> pb.OutputLogProbs:
    """The sampled tokens' logprobs and each step's top `k`, for the tokens of `sample`."""
    positions = sample.logprobs or []
    return pb.OutputLogProbs(
        token_logprobs=[pos[t].logprob for t, pos in zip(sample.token_ids, positions)],
        token_ids=list(sample.token_ids),
        top_logprobs=[_top(pos, k) for pos in positions])


def input_logprobs(output: RequestOutput, k: int) -> pb.InputLogProbs:
    """The prompt tokens' logprobs (none for the first) and each position's top `k`."""
    positions = output.prompt_logprobs or []
    return pb.InputLogProbs(
        token_logprobs=[pb.InputTokenLogProb() if pos is None
                        else pb.InputTokenLogProb(value=pos[t].logprob)
                        for t, pos in zip(output.prompt_token_ids, positions)],
        token_ids=list(output.prompt_token_ids),
        top_logprobs=[pb.TopLogProbs() if pos is None else _top(pos, k) for pos in positions])

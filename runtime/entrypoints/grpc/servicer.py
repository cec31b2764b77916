"""The VllmEngine servicer: token-in/token-out generation, embeddings, aborts and what a router
asks about the server, on the same AsyncLLM (and ServerState) as the HTTP routes."""
from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
import uuid
from typing import AsyncIterator

import grpc

from runtime import __version__
from runtime.engine.async_llm import (EngineDeadError, EngineRestartingError, QueueFullError,
                                      RequestFailedError, RequestStream)
from runtime.entrypoints.errors import APIError
from runtime.entrypoints.grpc import convert
from runtime.entrypoints.grpc import vllm_engine_pb2 as pb
from runtime.entrypoints.grpc import vllm_engine_pb2_grpc as pb_grpc
from runtime.entrypoints.serving import ServerState, check_budget, check_fits
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.pooling.params import PoolingParams
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# the gRPC status of an HTTP error the shared checks raise
STATUS_OF_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                  503: grpc.StatusCode.UNAVAILABLE}


ROUTER_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class Refused(Exception):
    """A request answered with a gRPC status instead of outputs."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def refusal(e: BaseException) -> Refused | BaseException:
    """The gRPC status for what the engine or a shared check raised (others pass through)."""
    if isinstance(e, Refused):
        return e
    if isinstance(e, ValueError):
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, QueueFullError):
        return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry later")
    if isinstance(e, (EngineRestartingError, EngineDeadError)):
        return Refused(grpc.StatusCode.UNAVAILABLE, str(e))
    if isinstance(e, RequestFailedError):
        return Refused(grpc.StatusCode.INTERNAL, str(e))
    if isinstance(e, APIError):
        return Refused(STATUS_OF_HTTP.get(e.status, grpc.StatusCode.INTERNAL), e.message)
    return e


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    """Each RPC of vllm_engine.proto; a request's id is the router's (or a fresh one)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        self.started = time.time()
        self.last_receive = 0.0
        self.running: dict[str, RequestStream] = {}  # Generate calls in flight, by request id

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        self.last_receive = time.time()
        try:
            stream, params = await self._submit(request)
        except BaseException as e:
            await _abort(context, e)
            return
        request_id = stream.request_id
        self.running[request_id] = stream
        num_tokens: dict[int, int] = {}  # by sample index, so far
        done: set[int] = set()  # the indices whose GenerateComplete went out
        try:
            async for output in stream:
                for sample in output.outputs:
                    if sample.index in done:  # an abort's final output repeats finished ones
                        continue
                    first = sample.index not in num_tokens
                    num_tokens[sample.index] = num_tokens.get(sample.index, 0) + \
                        len(sample.token_ids)
                    if request.stream:
                        yield self._chunk(output, sample, params, first)
                    if sample.finish_reason is not None:
                        done.add(sample.index)
                        yield self._complete(output, sample, params, not request.stream,
                                             num_tokens[sample.index])
        except BaseException as e:
            await _abort(context, e)
        finally:
            self.running.pop(request_id, None)
            stream.close()

    async def _submit(self, request: pb.GenerateRequest) -> tuple[RequestStream, SamplingParams]:
        """Check and queue the request; raises what `refusal` turns into a status."""
        state = self.state
        if self.engine.pooling is not None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "this model is a pooling model and does not generate: use Embed")
        unserved = convert.unserved_field(request)
        if unserved is not None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, unserved)
        kind = request.WhichOneof("input")
        if kind is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "give the prompt as tokenized.input_ids or text")
        lora = None
        if request.HasField("lora_name"):
            lora = state.lora_modules.get(request.lora_name)
            if lora is None:
                raise Refused(grpc.StatusCode.NOT_FOUND,
                              f"the LoRA adapter {request.lora_name!r} does not exist; this "
                              f"server serves {sorted(state.lora_modules)}")
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        if request_id in self.running or request_id in self.engine.streams:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"request_id {request_id!r} is already running")
        try:
            params = convert.sampling_params(request.sampling_params,
                                             self.engine.processor.sampling_defaults)
            if kind == "tokenized":
                prompt = {"prompt_token_ids": list(request.tokenized.input_ids)}
                if request.tokenized.original_text:
                    prompt["prompt"] = request.tokenized.original_text
            else:
                text, ids = await state.off_loop(self.engine.processor.inputs.tokenize,
                                                 request.text)
                prompt = {"prompt": text, "prompt_token_ids": ids}
            check_fits(state, 1, params)
            check_budget(state, prompt["prompt_token_ids"], params.max_tokens,
                         "sampling_params.max_tokens")
            stream = self.engine.add_request(request_id, prompt, params, stream=request.stream,
                                             lora_request=lora)
        except QueueFullError:
            state.metrics.on_request_rejected()
            raise
        return stream, params

    @staticmethod
    def _chunk(output: RequestOutput, sample: CompletionOutput, params: SamplingParams,
               first: bool) -> pb.GenerateResponse:
        chunk = pb.GenerateStreamChunk(
            token_ids=sample.token_ids, prompt_tokens=len(output.prompt_token_ids),
            completion_tokens=len(sample.token_ids), cached_tokens=output.num_cached_tokens,
            index=sample.index)
        if params.logprobs is not None:
            chunk.output_logprobs.CopyFrom(convert.output_logprobs(sample, params.logprobs))
        if first and params.prompt_logprobs is not None:
            chunk.input_logprobs.CopyFrom(convert.input_logprobs(output, params.prompt_logprobs))
        return pb.GenerateResponse(chunk=chunk)

    @staticmethod
    def _complete(output: RequestOutput, sample: CompletionOutput, params: SamplingParams,
                  with_prompt_logprobs: bool, num_tokens: int) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_ids=sample.token_ids, finish_reason=sample.finish_reason,
            prompt_tokens=len(output.prompt_token_ids), completion_tokens=num_tokens,
            cached_tokens=output.num_cached_tokens, index=sample.index)
        if params.logprobs is not None:
            complete.output_logprobs.CopyFrom(convert.output_logprobs(sample, params.logprobs))
        if with_prompt_logprobs and params.prompt_logprobs is not None:
            complete.input_logprobs.CopyFrom(
                convert.input_logprobs(output, params.prompt_logprobs))
        if isinstance(sample.stop_reason, int):
            complete.matched_token_id = sample.stop_reason
        elif isinstance(sample.stop_reason, str):
            complete.matched_stop_str = sample.stop_reason
        return pb.GenerateResponse(complete=complete)

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        for request_id in request.request_ids:
            if request_id in self.running:  # its stream ends with the aborted output
                self.engine.abort(request_id)
        return pb.AbortResponse()

    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        self.last_receive = time.time()
        pooling = self.engine.pooling
        try:
            if pooling is None:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              "this model generates text; Embed needs a pooling model "
                              "(serve one with --runner pooling)")
            if not request.HasField("tokenized"):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              "give the input as tokenized.input_ids")
            prompt = {"prompt_token_ids": list(request.tokenized.input_ids)}
            inputs = pooling.inputs([prompt], [PoolingParams()], "embed")
            results = await self.engine.encode(inputs)
        except BaseException as e:
            await _abort(context, e)
            return pb.EmbedResponse()
        output = pooling.embedding_outputs(inputs, results)[0]
        embedding = output.outputs.embedding
        return pb.EmbedResponse(embedding=embedding, prompt_tokens=len(output.prompt_token_ids),
                                embedding_dim=len(embedding))

    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=self.engine.is_healthy, message=health(self.engine))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        engine, hf = self.engine, self.engine.hf_config
        tokenizer = engine.tokenizer
        return pb.GetModelInfoResponse(
            model_path=engine.source.path, is_generation=engine.pooling is None,
            max_context_length=engine.max_model_len, vocab_size=hf.vocab_size,
            supports_vision=False, served_model_name=self.state.model_names[0],
            tokenizer_path=engine.source.tokenizer_path or engine.source.path,
            model_type=getattr(hf, "model_type", "") or "",
            architectures=list(getattr(hf, "architectures", None) or []),
            eos_token_ids=engine.processor.inputs.eos_token_ids,
            pad_token_id=_int(getattr(tokenizer, "pad_token_id", None)),
            bos_token_id=_int(getattr(tokenizer, "bos_token_id", None)),
            max_req_input_len=engine.max_model_len,
            default_sampling_params_json=_defaults_json(engine.processor.sampling_defaults))

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        config = self.engine.config
        return pb.GetServerInfoResponse(
            active_requests=len(self.engine.streams), is_paused=False,
            last_receive_timestamp=self.last_receive, uptime_seconds=time.time() - self.started,
            server_type="vllm-grpc", data_parallel_size=config.data_parallel_size,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            block_size=config.block_size, num_kv_blocks=self.engine.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens)

    async def GetLoads(self, request: pb.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        engine, stats = self.engine, self.engine.stats
        # a block holds block_size tokens on each decode-context-parallel rank
        capacity = (engine.num_blocks * engine.config.block_size
                    * engine.config.decode_context_parallel_size)
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=stats.num_running, num_waiting_reqs=stats.num_waiting,
            num_total_reqs=stats.num_running + stats.num_waiting,
            num_used_tokens=int(stats.kv_cache_usage * capacity),
            max_total_num_tokens=capacity, token_usage=stats.kv_cache_usage,
            cache_hit_rate=stats.prefix_cache_hit_rate,
            max_running_requests=engine.config.max_num_seqs)
        return pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            version=__version__, dp_rank_count=1, loads=[load])


def health(engine) -> str:
    if engine.is_healthy:
        return "healthy"
    return engine.dead_reason or "the engine core is restarting"


def _defaults_json(defaults: dict) -> str:
    """The generation config's sampling defaults a router may apply, as vLLM reports them."""
    shown = {k: v for k, v in defaults.items() if k in ROUTER_DEFAULT_KEYS}
    return json.dumps(shown, separators=(",", ":")) if shown else ""


def _int(value: int | None) -> int:
    return value if isinstance(value, int) else 0


async def _abort(context: grpc.aio.ServicerContext, e: BaseException) -> None:
    """End the call with the status for `e`; what is not a refusal is an internal error."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        raise e
    refused = refusal(e)
    if not isinstance(refused, Refused):
        logger.exception("gRPC call failed", exc_info=e)
        refused = Refused(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
    await context.abort(refused.code, str(refused))

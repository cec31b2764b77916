"""The engine core in its own process, and the messages it exchanges with the API process.

The API process binds two ZeroMQ sockets on Unix-domain (ipc) paths and spawns the core process,
which connects to both:

    API process  --PUSH-->  core process   AddRequests | FinishRequests | Sleep | WakeUp |
                                           UpdateWeights | Shutdown
    API process  <--PUSH--  core process   Ready | Outputs | RequestsFailed | Controlled |
                                           Failed

Messages are msgspec Structs, msgpack-encoded, one message per frame. The core loop drains its
input between steps, so a request added over the wire joins the running batch at the next step;
it blocks on the socket only when it has nothing to run, and exits when its parent is gone.
While it has work it sends something at least every HEARTBEAT_S, so that the API process can
tell a core that stopped stepping (frozen, or stuck in native code) from one that is busy.

Sleep, WakeUp and UpdateWeights (sleep mode and weight reload, runtime.engine.core) are each
answered by one `Controlled`, in the order they came.

A request that makes the core raise (in `add_request`, or in a step it took part in) is finished
in the core and reported in `RequestsFailed`; the core keeps stepping the others. Only an error
no request can be blamed for ends the process (`Failed`), and the API process restarts it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import ClassVar, Union

import msgspec
import zmq

from runtime.config import EngineConfig
from runtime.engine.core import CoreOutput, EngineBusyError, EngineCore
from runtime.lora.request import LoRARequest
from runtime.multimodal.inputs import MultiModalFeature, TensorData
from runtime.model_spec import ModelSpec
from runtime.pooling.params import PoolingParams
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # how often an idle core checks that its parent is still alive
# A core with work says it is stepping at least this often (an empty Outputs when its steps
# produced nothing, e.g. chunks of a long prefill): the API process's stall watchdog reads it.
HEARTBEAT_S = 0.5
# Test-only fault injection, off unless the core's environment names a token id: the core
# kills itself (SIGKILL) on receiving a request whose prompt holds that token.
KILL_ON_TOKEN_ENV = "RUNTIME_TEST_KILL_CORE_ON_TOKEN"


class CoreRequest(msgspec.Struct, array_like=True):
    """A `Request`'s constructor arguments, as they cross the wire."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    priority: int
    arrival_time: float
    parent_id: str
    sample_index: int
    leader_id: Union[str, None]
    lora_request: Union[LoRARequest, None] = None
    pooling_params: Union[PoolingParams, None] = None
    output_token_ids: list[int] = []  # generated on a core that died: it goes on from there
    mm_features: list[MultiModalFeature] = []
    prompt_embeds: Union[TensorData, None] = None

    @classmethod
    def of(cls, r: Request) -> "CoreRequest":
        return cls(r.request_id, r.prompt_token_ids, r.params, r.max_tokens, r.priority,
                   r.arrival_time, r.parent_id, r.sample_index, r.leader_id, r.lora_request,
                   r.pooling_params, r.output_token_ids, r.mm_features, r.prompt_embeds)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.params, self.max_tokens,
                       self.priority, self.arrival_time, self.parent_id, self.sample_index,
                       self.leader_id, self.lora_request, self.pooling_params,
                       self.output_token_ids, self.mm_features, self.prompt_embeds)


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[CoreRequest]


class FinishRequests(msgspec.Struct, tag=True, array_like=True):
    """End samples early: a stop string matched (status STOPPED) or the caller aborted."""

    request_ids: list[str]
    status: RequestStatus
    stop_reasons: list[Union[str, None]]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Sleep(msgspec.Struct, tag=True, array_like=True):
    level: int


class WakeUp(msgspec.Struct, tag=True, array_like=True):
    tags: Union[list[str], None]  # None: everything asleep


class UpdateWeights(msgspec.Struct, tag=True, array_like=True):
    model_path: str


class Controlled(msgspec.Struct, tag=True, array_like=True):
    """The answer to a Sleep, WakeUp or UpdateWeights: done (`error` None), or refused with
    the error's class name ("EngineBusyError", "ValueError") and message; and what is asleep
    after it."""

    error_type: Union[str, None]
    error: Union[str, None]
    asleep: list[str]


class CoreStats(msgspec.Struct, array_like=True, kw_only=True):
    """The scheduler and KV cache after a step, for /metrics and the waiting-queue bound
    (all zero: nothing has run yet)."""

    num_running: int = 0
    num_waiting: int = 0
    num_received: int = 0  # requests (samples) the core has taken off the wire so far
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    # speculative decoding, cumulative (see runtime.core.spec_stats)
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # structured outputs, cumulative: grammars compiled, their compile time, cache hits and
    # misses, compiles per bucket of runtime.structured_output.stats (empty: none yet)
    num_grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    num_grammar_cache_hits: int = 0
    num_grammar_cache_misses: int = 0
    grammar_compile_counts: list[int] = []
    # prefix cache, cumulative: prompt tokens looked up, and those found cached
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # encoder cache, cumulative: images needed by a request for the first time, and those
    # found cached (the others ran the encoder)
    num_encoder_cache_queries: int = 0
    num_encoder_cache_hits: int = 0
    # steps per bucket of runtime.engine.step_stats (empty: none yet), and their tokens
    step_token_counts: list[int] = []
    num_step_tokens: int = 0
    # with LoRA: the adapters (by name) of the running and of the waiting requests
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # with a KV connector: its cumulative counters (KVConnectorScheduler.stats)
    kv_connector: dict[str, float] = {}

    # the fields that are a share, averaged over replicas; every other number is summed
    SHARES: ClassVar[tuple[str, ...]] = ("kv_cache_usage", "prefix_cache_hit_rate")
    # per-bucket counts, summed bucket by bucket; names, joined
    BUCKETS: ClassVar[tuple[str, ...]] = ("grammar_compile_counts", "step_token_counts")
    NAMES: ClassVar[tuple[str, ...]] = ("running_lora_adapters", "waiting_lora_adapters")
    # counters by name, summed name by name
    MAPS: ClassVar[tuple[str, ...]] = ("kv_connector",)

    @classmethod
    def merge(cls, replicas: list["CoreStats"]) -> "CoreStats":
        """The stats of several replicas as one engine's: counts summed, shares averaged."""
        if not replicas:
            return cls()
        merged = {}
        for name in cls.__struct_fields__:
            values = [getattr(s, name) for s in replicas]
            if name in cls.NAMES:
                merged[name] = sorted(set().union(*values))
            elif name in cls.MAPS:
                merged[name] = {k: sum(v.get(k, 0) for v in values)
                                for k in sorted(set().union(*values))}
            elif name in cls.BUCKETS:
                merged[name] = [sum(c) for c in zip(*(v for v in values if v))]
            elif name in cls.SHARES:
                merged[name] = sum(values) / len(values)
            else:
                merged[name] = sum(values)
        return cls(**merged)


class Ready(msgspec.Struct, tag=True, array_like=True):
    max_model_len: int
    num_blocks: int


class Outputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[CoreOutput]
    stats: CoreStats


class RequestsFailed(msgspec.Struct, tag=True, array_like=True):
    """Requests (by their API-side id, `parent_id`) the core raised on and has finished."""

    request_ids: list[str]
    error: str


class Failed(msgspec.Struct, tag=True, array_like=True):
    error: str


Control = Union[Sleep, WakeUp, UpdateWeights]
ToCore = Union[AddRequests, FinishRequests, Sleep, WakeUp, UpdateWeights, Shutdown]
FromCore = Union[Ready, Outputs, RequestsFailed, Controlled, Failed]


def run_core_process(config: EngineConfig, spec: ModelSpec, input_path: str, output_path: str,
                     log_level: int) -> None:
    """The core process's entry point: load the model, say Ready, then step until Shutdown."""
    # Ctrl-C and SIGTERM to the process group are the server's to handle: it stops the core
    # (Shutdown) after its graceful shutdown, and a core whose parent is gone stops by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_path)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.connect(output_path)
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        from runtime.engine.llm_engine import build_core
        core = build_core(config, spec)
        outbox.send(encoder.encode(Ready(core.model_config.max_model_len, core.num_blocks)))
        CoreLoop(core, inbox, outbox, encoder, parent).run()
    except Exception as e:  # reported to the API process, which fails its requests
        logger.exception("engine core failed")
        outbox.send(encoder.encode(Failed(f"{type(e).__name__}: {e}")))
        raise SystemExit(1)
    finally:
        if core is not None:
            core.shutdown()  # stops the workers of a multi-rank executor
        outbox.close(linger=1000)
        inbox.close(linger=0)
        context.term()


class CoreLoop:
    """Steps the core while it has work, between steps applying what came over the wire."""

    def __init__(self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket,
                 encoder: msgspec.msgpack.Encoder, parent: int) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.parent = parent  # the API process: when it is gone, so is our reason to run
        self.num_received = 0
        self.running = True
        self.last_sent = time.monotonic()
        fault = os.environ.get(KILL_ON_TOKEN_ENV)
        self.kill_on_token = int(fault) if fault else None

    def run(self) -> None:
        while self.running:
            if os.getppid() != self.parent:
                logger.warning("the API process is gone: engine core exiting")
                return
            idle = not self.core.has_unfinished()
            changed = self._drain(block=idle)
            if not self.running:
                return
            if idle and not changed:
                self.core.check_health()  # a worker that died while idle fails the core now
            try:
                outputs = self.core.step() if self.core.has_unfinished() else []
            except Exception as e:
                self._fail_running(e)
                outputs, changed = [], True
            if self.core.failed:
                outputs = self._fail_requests(outputs)
            if outputs or changed or time.monotonic() - self.last_sent > HEARTBEAT_S:
                self._send(Outputs(outputs, self._stats()))

    def _send(self, message: Outputs | RequestsFailed) -> None:
        self.outbox.send(self.encoder.encode(message))
        self.last_sent = time.monotonic()

    def _fail_running(self, error: Exception) -> None:
        """A step raised: finish the requests of the running batch, which it was stepping, and
        report them. With none running the error is the core's own, and it propagates."""
        running = list(self.core.scheduler.running)
        if not running:
            raise error
        logger.exception("a step failed; failing its %d requests", len(running))
        for r in running:
            self.core.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
        self._report({r.parent_id for r in running}, error)

    def _fail_requests(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """The requests the step ended with an error fail on the API side; their final outputs
        are left out."""
        failed, self.core.failed = self.core.failed, []
        for r, error in failed:
            self._report({r.parent_id}, ValueError(error))
        ids = {r.request_id for r, _ in failed}
        return [o for o in outputs if o.request_id not in ids]

    def _report(self, request_ids: set[str], error: Exception) -> None:
        self._send(RequestsFailed(sorted(request_ids), f"{type(error).__name__}: {error}"))

    def _drain(self, block: bool) -> bool:
        """Apply every waiting message (waiting up to IDLE_POLL_MS for one if `block`);
        returns whether any came."""
        changed = False
        timeout = IDLE_POLL_MS if block else 0
        while self.running and self.inbox.poll(timeout):
            self._apply(self.decoder.decode(self.inbox.recv()))
            changed, timeout = True, 0
        return changed

    def _apply(self, message: ToCore) -> None:
        if isinstance(message, AddRequests):
            for r in message.requests:
                if self.kill_on_token is not None and self.kill_on_token in r.prompt_token_ids:
                    logger.error("%s: killing the engine core (test fault injection)",
                                 KILL_ON_TOKEN_ENV)
                    os.kill(os.getpid(), signal.SIGKILL)
                try:
                    self.core.add_request(r.to_request())
                except Exception as e:
                    logger.exception("request %s could not be added", r.request_id)
                    with contextlib.suppress(Exception):  # it may be half added
                        self.core.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
                    self._report({r.parent_id}, e)
            self.num_received += len(message.requests)
        elif isinstance(message, FinishRequests):
            for request_id, stop in zip(message.request_ids, message.stop_reasons):
                self.core.finish_request(request_id, message.status, stop)
        elif isinstance(message, (Sleep, WakeUp, UpdateWeights)):
            self.outbox.send(self.encoder.encode(self._control(message)))
        else:
            self.running = False

    def _control(self, message: Control) -> Controlled:
        """Apply a sleep-mode or weight message; a refusal is answered, a worker's failure
        raises (the core process fails and is restarted)."""
        try:
            if isinstance(message, Sleep):
                self.core.sleep(message.level)
            elif isinstance(message, WakeUp):
                self.core.wake_up(message.tags)
            else:
                self.core.update_weights(message.model_path)
        except (EngineBusyError, ValueError) as e:
            return Controlled(type(e).__name__, str(e), sorted(self.core.asleep))
        return Controlled(None, None, sorted(self.core.asleep))

    def _stats(self) -> CoreStats:
        scheduler, kv = self.core.scheduler, self.core.kv
        spec, grammars = scheduler.spec_stats, self.core.structured
        stats = CoreStats(
            num_running=len(scheduler.running), num_waiting=scheduler.num_waiting(),
            num_received=self.num_received, kv_cache_usage=kv.usage(),
            prefix_cache_hit_rate=kv.hit_rate(), num_preemptions=scheduler.num_preemptions,
            num_spec_drafts=spec.num_drafts, num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens,
            num_prefix_cache_queries=kv.num_cache_queries,
            num_prefix_cache_hits=kv.num_cache_hits,
            num_encoder_cache_queries=scheduler.encoder_cache.num_queries,
            num_encoder_cache_hits=scheduler.encoder_cache.num_hits,
            step_token_counts=list(self.core.step_tokens.counts),
            num_step_tokens=self.core.step_tokens.total,
            kv_connector=self.core.kv_connector.stats() if self.core.kv_connector else {})
        if grammars:
            stats.num_grammar_compiles = grammars.num_compiles
            stats.grammar_compile_seconds = grammars.compile_seconds
            stats.num_grammar_cache_hits = grammars.num_cache_hits
            stats.num_grammar_cache_misses = grammars.num_cache_misses
            stats.grammar_compile_counts = list(grammars.compile_counts)
        if self.core.config.enable_lora:
            stats.running_lora_adapters = _adapters(scheduler.running)
            stats.waiting_lora_adapters = _adapters(scheduler.waiting)
        return stats


def _adapters(requests) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})

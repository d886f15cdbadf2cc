"""The wire between the API process and the engine-core process: msgspec structs,
one per msgpack frame, on two ZeroMQ PUSH/PULL pipes.

    API process (EngineCoreClient)                  engine-core process (process.py)
      input PUSH  ---- AddRequest | AbortRequests | UtilityCall | Shutdown ---->  PULL
      output PULL <--- Ready | StartupFailed | Admitted | StepReport | RequestsFailed |
                       UtilityResult | EngineDead ------------------------------  PUSH

Outputs travel as deltas (``WireOutput``): the client already knows the prompt it
sent and keeps the token ids and logprobs it has received, so a step costs the new
tokens, not the whole history. ``StepReport`` is sent every loop iteration (each
step, or every idle wait), so it doubles as the heartbeat and carries the gauges
(``EngineSnapshot``, which AsyncLLM's transport hands over as it is). The ``ToCore`` commands are also what AsyncLLM puts, unencoded, on its in-process queue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from treadle.config import (
    EngineDeadError,
    InvalidRequestError,
    ModelConfig,
    QueueFullError,
    StepFailedError,
    TreadleError,
)
from treadle.engine.outputs import Logprob, RequestMetrics, RequestOutput
from treadle.sampling_params import SamplingParams, SamplingParamsError


# -- what the step loop reports, through either transport (AsyncLLM's: unencoded) ---------------
@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges and counters, refreshed by the step loop on every iteration."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0  # run through the model: prompt, recompute and decode tokens
    spec_decode: dict[str, Any] | None = None  # SpecDecodeStats.as_dict(), when speculating
    num_waiting_prompt_tokens: int = 0  # prompt tokens not yet computed (waiting and running requests)
    kv_transfer: dict[str, Any] | None = None  # KVTransferStats.as_dict(), with kv_transfer_config
    predicted_remaining_tokens: int | None = None  # sum of predicted output tokens left; None: no length predictor


@dataclass(frozen=True)
class StepResult:
    """What a step produced: outputs, or the StepFailedError naming the requests it failed."""

    outputs: list[RequestOutput]
    failed: StepFailedError | None = None


class _Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    pass


# -- API process -> engine core ---------------------------------------------------------
class AddRequest(_Msg):
    request_id: str
    prompt: Any  # the engine's PromptType; EngineCoreClient sends it tokenized: {"prompt", "prompt_token_ids"} or ids
    params: SamplingParams
    priority: int
    max_waiting: int | None
    arrival_time: float  # time.monotonic() (one clock for every process of the machine)


class AbortRequests(_Msg):
    request_ids: list[str]


class UtilityCall(_Msg):
    call_id: int
    method: str  # one of loop.UTILITIES
    args: list[Any] = []


class Shutdown(_Msg):
    pass


# -- engine core -> API process -------------------------------------------------------
class WireError(msgspec.Struct, array_like=True):
    kind: str  # a key of _ERROR_KINDS, "sampling_params" or "invalid_request"
    message: str
    param: str | None = None
    code: str | None = None  # InvalidRequestError's OpenAI error code


class Ready(_Msg):
    """The engine is built. It also hands over what the API process needs of the checkpoint,
    so that process never opens it (nor imports torch): the model's config and tokenizer."""

    max_model_len: int
    snapshot: EngineSnapshot
    model_config: ModelConfig
    max_num_seqs: int = 0
    length_predictor: str | None = None  # the engine's predictor directory, loaded by the client too (/tokenize)
    tokenizer: dict[str, Any] | None = None  # the engine's, as Tokenizer.to_dict(); None: skip_tokenizer_init


class StartupFailed(_Msg):
    error: WireError


class Admitted(_Msg):
    """The answers to the AddRequests applied this iteration: error None means queued."""

    results: list[tuple[str, WireError | None]]


class WireCompletion(msgspec.Struct, array_like=True, omit_defaults=True):
    index: int
    text: str  # the whole text so far (a stop string can shorten it, so it is not a delta)
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class WireOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    finished: bool
    completions: list[WireCompletion]
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # in the request's first output only
    kv_transfer_params: dict[str, Any] | None = None  # P/D producer, in the final output


class StepReport(_Msg):
    outputs: list[WireOutput]
    snapshot: EngineSnapshot
    heartbeat: float  # time.monotonic() in the engine process when the iteration ended


class RequestsFailed(_Msg):
    """A step failed (StepFailedError): these requests were aborted with it; the engine goes on."""

    request_ids: list[str]
    reason: str  # repr of the step's exception


class UtilityResult(_Msg):
    call_id: int
    value: Any = None
    error: WireError | None = None


class EngineDead(_Msg):
    reason: str


ToCore = AddRequest | AbortRequests | UtilityCall | Shutdown
FromCore = Ready | StartupFailed | Admitted | StepReport | RequestsFailed | UtilityResult | EngineDead

_ERROR_KINDS: dict[str, type[TreadleError]] = {
    "treadle": TreadleError, "queue_full": QueueFullError, "engine_dead": EngineDeadError,
}


def wire_error(e: BaseException) -> WireError:
    if isinstance(e, SamplingParamsError):
        return WireError("sampling_params", str(e), e.param)
    if isinstance(e, InvalidRequestError):
        return WireError("invalid_request", str(e), e.param, e.code)
    kind = next((k for k, cls in _ERROR_KINDS.items() if type(e) is cls), "treadle")
    return WireError(kind, str(e) if isinstance(e, TreadleError) else f"{type(e).__name__}: {e}")


def from_wire(err: WireError) -> TreadleError:
    """The TreadleError (of the same kind) that ``wire_error`` sent."""
    if err.kind == "sampling_params":
        return SamplingParamsError(err.param or "", err.message)
    if err.kind == "invalid_request":
        return InvalidRequestError(err.message, err.param, err.code)
    return _ERROR_KINDS.get(err.kind, TreadleError)(err.message)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_core_decoder() -> msgspec.msgpack.Decoder[ToCore]:
    return msgspec.msgpack.Decoder(ToCore)  # type: ignore[arg-type]


def from_core_decoder() -> msgspec.msgpack.Decoder[FromCore]:
    return msgspec.msgpack.Decoder(FromCore)  # type: ignore[arg-type]

"""Frames between the engine process and worker processes (pyzmq multipart, msgpack bodies).

    engine -> worker   [b"step", msgpack(SchedulerOutput)]  |  [b"stop", b""]
                       grammar socket: [b"grammar", msgpack((seq, StructuredOutputsParams))]
    worker -> engine   [rank, b"ready", msgpack(KVCapacity)]        after loading
                       [rank, b"ok", b"" | msgpack(KVConnectorOutput)]   a step done (ranks <
                                                                    last; P/D: their transfer report)
                       [rank, b"out", msgpack(ModelRunnerOutput)]   a step done (last rank)
                       [rank, b"err", msgpack(WorkerError)]         loading or a step failed
                       grammar-ack socket: [rank, msgpack((seq, error or None))]  compiled (or not)

The step input and output are the plain dataclasses of ``core/step_data.py``; msgspec encodes
and decodes them (floats as float64, so logprobs cross unchanged).
"""
from __future__ import annotations

import msgspec

from treadle.core.kv_connector_data import KVConnectorOutput
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.sampling_params import StructuredOutputsParams

STEP, STOP, GRAMMAR = b"step", b"stop", b"grammar"
READY, OK, OUT, ERR = b"ready", b"ok", b"out", b"err"


class WorkerError(msgspec.Struct):
    message: str
    user_error: bool  # a TreadleError (say it as it is) rather than a crash (include the type)


class Codec:
    """msgpack encoders and typed decoders for the frames above."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._sched = msgspec.msgpack.Decoder(SchedulerOutput)
        self._output = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._capacity = msgspec.msgpack.Decoder(tuple[int, int])
        self._error = msgspec.msgpack.Decoder(WorkerError)
        self._kv = msgspec.msgpack.Decoder(KVConnectorOutput)
        self._grammar = msgspec.msgpack.Decoder(tuple[int, StructuredOutputsParams])
        self._grammar_ack = msgspec.msgpack.Decoder(tuple[int, str | None])

    def encode(self, obj: object) -> bytes:
        return self._encoder.encode(obj)

    def decode_step(self, data: bytes) -> SchedulerOutput:
        return self._sched.decode(data)

    def decode_output(self, data: bytes) -> ModelRunnerOutput:
        return self._output.decode(data)

    def decode_capacity(self, data: bytes) -> tuple[int, int]:
        return self._capacity.decode(data)

    def decode_error(self, data: bytes) -> WorkerError:
        return self._error.decode(data)

    def encode_kv_output(self, out: KVConnectorOutput | None) -> bytes:
        return b"" if out is None else self._encoder.encode(out)

    def decode_kv_output(self, data: bytes) -> KVConnectorOutput | None:
        return self._kv.decode(data) if data else None

    def decode_grammar(self, data: bytes) -> tuple[int, StructuredOutputsParams]:
        return self._grammar.decode(data)

    def decode_grammar_ack(self, data: bytes) -> tuple[int, str | None]:
        return self._grammar_ack.decode(data)

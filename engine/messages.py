"""What crosses a process boundary: typed messages between the server and the engine core, and
between rank 0 and the tensor-parallel workers.

Each message is a frozen dataclass whose `kind` (a `MessageKind`) names it; receivers dispatch
with `match` on the class, never on a position in a tuple. Contents are plain data only:
`ProcessedPrompt` (token ids, `SamplingParams`, cache salt) in, `RequestDelta`s (only what is
new) and an `EngineStats` snapshot out, a `StepRecord` to each worker. One codec serves both
pipes: pickle protocol 5, one frame per message (`benchmarks/bench_ipc.py` measures it).

server -> core     AddRequest, AbortRequest, Stop
core -> server     Ready or StartFailed (once, after loading), then StepOutputs after every step,
                   Stats after commands that ran no step, Rejected / Overloaded for a request
                   that add refused, StepFailedRequests when a step raised, Dead when the loop died
rank 0 -> worker   WorkerStep every step, Stop
worker -> rank 0   WorkerLoaded or StartFailed (once, after loading its shard)
"""

from __future__ import annotations

import enum
import operator
import pickle
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvserve.engine.config import RuntimeInfo
    from kvserve.engine.input_processor import ProcessedPrompt
    from kvserve.engine.outputs import EngineStats, RequestDelta
    from kvserve.engine.step_record import StepRecord


class MessageKind(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    STOP = "stop"
    READY = "ready"
    START_FAILED = "start_failed"
    STEP_OUTPUTS = "step_outputs"
    STATS = "stats"
    REJECTED = "rejected"
    OVERLOADED = "overloaded"
    STEP_FAILED = "step_failed"
    DEAD = "dead"
    WORKER_STEP = "worker_step"
    WORKER_LOADED = "worker_loaded"


_BY_KIND: dict[str, type] = {}  # MessageKind value -> message class


def _message(cls):
    """A frozen, slotted dataclass, registered for the codec under its `kind`."""
    cls = dataclass(frozen=True, slots=True)(cls)
    names = [f.name for f in fields(cls)]
    if len(names) > 1:
        cls.field_values = operator.attrgetter(*names)  # -> a tuple (not a descriptor: no binding)
    else:  # attrgetter of one name returns the bare value
        cls.field_values = staticmethod(lambda message, names=names: tuple(getattr(message, n) for n in names))
    _BY_KIND[cls.kind.value] = cls
    return cls


# ---- server -> core ------------------------------------------------------------------------
@_message
class AddRequest:
    kind: ClassVar = MessageKind.ADD
    request_id: str
    prompt: ProcessedPrompt
    arrival_time: float


@_message
class AbortRequest:
    """The client has gone: the core drops the request and frees its blocks."""

    kind: ClassVar = MessageKind.ABORT
    request_id: str


@_message
class Stop:
    """Finish the current step and exit (server -> core, and rank 0 -> worker)."""

    kind: ClassVar = MessageKind.STOP


# ---- core -> server ------------------------------------------------------------------------
@_message
class Ready:
    kind: ClassVar = MessageKind.READY
    info: RuntimeInfo
    stats: EngineStats


@_message
class StartFailed:
    """Loading failed (core -> server, worker -> rank 0): the exception, or its text."""

    kind: ClassVar = MessageKind.START_FAILED
    error: BaseException | str


@_message
class StepOutputs:
    kind: ClassVar = MessageKind.STEP_OUTPUTS
    deltas: list[RequestDelta]
    stats: EngineStats


@_message
class Stats:
    kind: ClassVar = MessageKind.STATS
    stats: EngineStats


@_message
class Rejected:
    """The request is invalid (a ValueError: a bad grammar, a limit): the client gets a 400."""

    kind: ClassVar = MessageKind.REJECTED
    request_id: str
    message: str


@_message
class Overloaded:
    """The request was refused for now (the grammar compile queue is full): retry later."""

    kind: ClassVar = MessageKind.OVERLOADED
    request_id: str
    message: str


@_message
class StepFailedRequests:
    """A step raised; its requests are aborted, the engine goes on."""

    kind: ClassVar = MessageKind.STEP_FAILED
    request_ids: list[str]
    message: str
    stats: EngineStats


@_message
class Dead:
    """The loop died; the core process exits."""

    kind: ClassVar = MessageKind.DEAD
    message: str


# ---- rank 0 <-> tensor-parallel workers ----------------------------------------------------
@_message
class WorkerStep:
    kind: ClassVar = MessageKind.WORKER_STEP
    record: StepRecord
    prev_sampled_token_ids: tuple[int | None, ...]  # rank 0's samples of the step before (None: no sample)
    # speculative decoding: how many of each request's drafts rank 0 accepted the step before
    prev_num_accepted: tuple[int, ...] = ()


@_message
class WorkerLoaded:
    kind: ClassVar = MessageKind.WORKER_LOADED


Message = (AddRequest | AbortRequest | Stop | Ready | StartFailed | StepOutputs | Stats | Rejected | Overloaded
           | StepFailedRequests | Dead | WorkerStep | WorkerLoaded)
MESSAGE_TYPES = Message.__args__


def encode(message: Message) -> bytes:
    """On the wire a message is the tuple (kind, *field values): unpickling a class reference
    per message would cost more than the rest of a small step message (`benchmarks/bench_ipc.py`)."""
    return pickle.dumps((message.kind.value, *message.field_values(message)), protocol=5)


def decode(data: bytes) -> Message:
    """The message in `data`; TypeError if the frame holds anything but a message."""
    frame = pickle.loads(data)
    cls = _BY_KIND.get(frame[0]) if isinstance(frame, tuple) and frame else None
    if cls is None:
        raise TypeError(f"not a kvserve message: {type(frame).__name__} {str(frame)[:80]}")
    return cls(*frame[1:])

"""What crosses a process boundary: typed messages between the server and the engine core, and
between rank 0 and the tensor-parallel workers.

Each message is a frozen `msgspec.Struct` in one tagged union (`Message`): on the wire it is a
MessagePack array whose first element is the message's tag and the rest its fields in order.
`decode` checks the whole frame against the union's types, nested records included, so a
malformed or unknown frame is an error naming what and where, never a wrong object; receivers
dispatch with `match` on the class. Contents are plain data only: `ProcessedPrompt` (token ids,
`SamplingParams`, cache salt) in, `RequestDelta`s (only what is new) and an `EngineStats`
snapshot out, a `StepRecord` to each worker. Errors cross as text (`StartFailed`). No array
crosses: a step's record is ids and numbers, its outputs token ids and logprobs.

server -> core     AddRequest, AbortRequest, Stop
core -> server     Ready or StartFailed (once, after loading), then StepOutputs after every step,
                   Stats after commands that ran no step, Rejected / Overloaded for a request
                   that add refused, StepFailedRequests when a step raised, Dead when the loop died
rank 0 -> worker   WorkerStep every step, WorkerAddLoRA / WorkerRemoveLoRA between steps, Stop
worker -> rank 0   WorkerLoaded or StartFailed (once, after loading its shard), WorkerLoRAResult
                   after each WorkerAddLoRA
"""

from __future__ import annotations

import builtins
import importlib
import numbers
import traceback as traceback_module

import msgspec

from kvserve.engine.config import RuntimeInfo
from kvserve.engine.core.step_record import StepRecord
from kvserve.engine.input_processor import ProcessedPrompt
from kvserve.engine.outputs import EngineStats, RequestDelta


class _Message(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Base of every message: the subclass's `tag` is the frame's first element."""


# ---- server -> core ------------------------------------------------------------------------
class AddRequest(_Message, frozen=True, tag="add"):
    request_id: str
    prompt: ProcessedPrompt
    arrival_time: float


class AbortRequest(_Message, frozen=True, tag="abort"):
    """The client has gone: the core drops the request and frees its blocks."""

    request_id: str


class Stop(_Message, frozen=True, tag="stop"):
    """Finish the current step and exit (server -> core, and rank 0 -> worker)."""


# ---- core -> server ------------------------------------------------------------------------
class Ready(_Message, frozen=True, tag="ready"):
    info: RuntimeInfo
    stats: EngineStats


class StartFailed(_Message, frozen=True, tag="start_failed"):
    """Loading failed (core -> server, worker -> rank 0). The exception crosses as text: its type
    (`module.QualName`), its message and the traceback where it was raised."""

    error_type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, error: BaseException) -> StartFailed:
        kind = type(error)
        return cls(
            error_type=f"{kind.__module__}.{kind.__qualname__}",
            message=str(error),
            traceback="".join(traceback_module.format_exception(error)),
        )

    @property
    def text(self) -> str:
        return f"{self.error_type.rpartition('.')[2]}: {self.message}"

    def to_exception(self) -> BaseException:
        """The error to raise on this side: the same class for Python's own exceptions and
        kvserve's; otherwise a RuntimeError naming the type. The far side's traceback is a note."""
        error = _rebuild(self.error_type, self.message)
        if self.traceback:
            error.add_note(f"raised in the engine process:\n{self.traceback.rstrip()}")
        return error


def _rebuild(error_type: str, message: str) -> BaseException:
    module_name, _, name = error_type.rpartition(".")
    cls = None
    if module_name == "builtins":
        cls = getattr(builtins, name, None)
    elif module_name.startswith("kvserve.") and "." not in name:  # never import anything else
        try:
            cls = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            cls = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 - a constructor that wants more than a message
            pass
    return RuntimeError(f"{name}: {message}")


class StepOutputs(_Message, frozen=True, tag="step_outputs"):
    deltas: list[RequestDelta]
    stats: EngineStats


class Stats(_Message, frozen=True, tag="stats"):
    stats: EngineStats


class Rejected(_Message, frozen=True, tag="rejected"):
    """The request is invalid (a ValueError: a bad grammar, a limit): the client gets a 400."""

    request_id: str
    message: str


class Overloaded(_Message, frozen=True, tag="overloaded"):
    """The request was refused for now (the grammar compile queue is full): retry later."""

    request_id: str
    message: str


class StepFailedRequests(_Message, frozen=True, tag="step_failed"):
    """A step raised; its requests are aborted, the engine goes on."""

    request_ids: list[str]
    message: str
    stats: EngineStats


class Dead(_Message, frozen=True, tag="dead"):
    """The loop died; the core process exits."""

    message: str


# ---- rank 0 <-> tensor-parallel workers ----------------------------------------------------
class WorkerStep(_Message, frozen=True, tag="worker_step"):
    record: StepRecord
    prev_sampled_token_ids: tuple[
        int | None, ...
    ]  # rank 0's samples of the step before (None: no sample)
    # speculative decoding: how many of each request's drafts rank 0 accepted the step before
    prev_num_accepted: tuple[int, ...] = ()


class WorkerLoaded(_Message, frozen=True, tag="worker_loaded"):
    pass


class WorkerAddLoRA(_Message, frozen=True, tag="worker_add_lora"):
    """Read and check a LoRA adapter's part for this rank now (docs/lora.md); answered by a
    `WorkerLoRAResult`."""

    lora_id: int
    name: str
    path: str
    in_use: tuple[int, ...] = ()  # the adapters of unfinished requests: reading this one keeps them


class WorkerRemoveLoRA(_Message, frozen=True, tag="worker_remove_lora"):
    """Forget a LoRA adapter (unanswered: the pipe keeps it in order with the steps)."""

    lora_id: int


class WorkerLoRAResult(_Message, frozen=True, tag="worker_lora_result"):
    error: str | None = None  # why the adapter was refused (None: it is read)


Message = (
    AddRequest
    | AbortRequest
    | Stop
    | Ready
    | StartFailed
    | StepOutputs
    | Stats
    | Rejected
    | Overloaded
    | StepFailedRequests
    | Dead
    | WorkerStep
    | WorkerLoaded
    | WorkerAddLoRA
    | WorkerRemoveLoRA
    | WorkerLoRAResult
)
MESSAGE_TYPES: tuple[type[_Message], ...] = Message.__args__


def _plain_number(value: object) -> int | float:
    """A numpy scalar that slipped into a record crosses as the Python number it equals."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{type(value).__name__} cannot cross a process boundary: {value!r}")


# both are thread-safe: the server sends from several threads
_encoder = msgspec.msgpack.Encoder(enc_hook=_plain_number)
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """The message in `data`; TypeError naming the problem if the frame is not a well-formed message."""
    try:
        return _decoder.decode(data)
    except (
        ValueError,
        TypeError,
    ) as e:  # msgspec's (a wrong tag, field type or count) or a record's own check
        raise TypeError(f"not a kvserve message: {e}") from None

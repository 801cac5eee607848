"""What the server process and the engine core process say to each other.

Every message is a tuple whose first item is its kind, pickled with protocol 5 and
sent as one frame over a `multiprocessing` pipe. Contents are plain data:
`ProcessedPrompt` (token ids + `SamplingParams` + cache salt) in, `RequestDelta`s (only what is
new) and an `EngineStats` snapshot out. docs/benchmarks.md has the codec's measured
cost; at one message per step it is a few microseconds against a step of milliseconds.

server -> core:
    (ADD, request_id, ProcessedPrompt, arrival_time)
    (ABORT, request_id)
    (STOP,)
core -> server:
    (READY, RuntimeInfo, EngineStats)            once, after loading
    (FAILED, exception)                          once, instead of READY
    (STEP, list[RequestDelta], EngineStats)      after every step
    (STATS, EngineStats)                         after commands that ran no step
    (REJECTED, request_id, message)              add_processed refused it (ValueError)
    (OVERLOADED, request_id, message)            the grammar compile queue is full (retry later)
    (FAILED_REQUESTS, request_ids, message, EngineStats)  a step raised; those requests are aborted
    (DEAD, message)                              the loop died; the process exits
"""

from __future__ import annotations

import pickle

ADD, ABORT, STOP = "add", "abort", "stop"
READY, FAILED, STEP, STATS, REJECTED, OVERLOADED, FAILED_REQUESTS, DEAD = (
    "ready", "failed", "step", "stats", "rejected", "overloaded", "failed_requests", "dead")


def encode(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=5)


def decode(data: bytes) -> tuple:
    return pickle.loads(data)

"""The engine's exceptions, in a module that imports neither torch nor the web stack, so the
server (and anything else) can catch them without loading the engine."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core stopped on an unrecoverable error; the engine serves no more requests."""


class EngineShutDownError(EngineDeadError):
    """The engine was shut down on purpose (e.g. the server's drain period ran out)."""


class EngineOverloadedError(RuntimeError):
    """The engine refused the request for now (the grammar compile queue is full): retry later."""


class StepFailed(RuntimeError):
    """A step raised; its requests were aborted. The cause is chained."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"step failed for requests {request_ids}")
        self.request_ids = request_ids


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or failed a step: the engine cannot go on."""

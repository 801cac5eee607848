"""A test double of the engine's `Executor`: it runs another one's steps and raises `InjectedFault`
(a simulated device error) on chosen steps.

In this process: `engine.runner = FaultyExecutor(engine.runner, first=2, last=3)`. In an engine
core process: `AsyncLLM(..., executor_wrapper=faults("2+"))`. In a server: `ServerProcess(...,
launcher=fault_server_launcher("2+"))` (tests/fault_server.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from kvserve.engine.worker.executor_protocol import Executor


class InjectedFault(RuntimeError):
    """What a `FaultyExecutor` raises on its chosen steps."""


def parse_fault_steps(spec: str) -> tuple[int, int | None] | None:
    """`N` fails step N (steps count from 1), `N-M` steps N to M, `N+` step N and every later one;
    empty: no faults. Returns (first, last or None)."""
    spec = spec.strip()
    if not spec:
        return None
    try:
        if spec.endswith("+"):
            steps = (int(spec[:-1]), None)
        else:
            first, dash, last = spec.partition("-")
            steps = (int(first), int(last) if dash else int(first))
    except ValueError:
        steps = (0, 0)
    if steps[0] < 1 or (steps[1] is not None and steps[1] < steps[0]):
        raise ValueError(f"fault steps {spec!r}: expected N, N-M or N+ with 1 <= N <= M")
    return steps


class FaultyExecutor:
    """Delegates everything to `inner`; `execute` raises `InjectedFault` on steps first..last
    (None: forever), counting the steps it is asked to run from 1."""

    def __init__(self, inner: Executor, first: int, last: int | None) -> None:
        self.inner, self.first, self.last = inner, first, last
        self.num_steps = 0

    def execute(self, step, grammar_bitmask=None):
        self.num_steps += 1
        if self.num_steps >= self.first and (self.last is None or self.num_steps <= self.last):
            raise InjectedFault(f"injected fault in step {self.num_steps}")
        return self.inner.execute(step, grammar_bitmask)

    def warm_up(self) -> bool:
        return self.inner.warm_up()

    def shutdown(self) -> None:
        self.inner.shutdown()

    @property
    def dead_reason(self) -> str | None:
        return self.inner.dead_reason

    @property
    def device(self):
        return self.inner.device

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def num_kv_blocks(self) -> int:
        return self.inner.num_kv_blocks

    @property
    def attn_backend(self):
        return self.inner.attn_backend

    @property
    def attn_layers(self):
        return self.inner.attn_layers

    @property
    def has_cuda_graphs(self) -> bool:
        return self.inner.has_cuda_graphs

    @property
    def weights_report(self):
        return self.inner.weights_report


def faults(spec: str) -> Callable[[Executor], Executor]:
    """An `executor_wrapper` (picklable) that fails the steps `spec` names (`parse_fault_steps`)."""
    first, last = parse_fault_steps(spec)
    return functools.partial(FaultyExecutor, first=first, last=last)


def fault_server_launcher(spec: str) -> tuple[str, ...]:
    """`ServerProcess(..., launcher=...)`: `kvserve serve` whose engine fails the steps `spec` names."""
    return (str(Path(__file__).with_name("fault_server.py")), spec)

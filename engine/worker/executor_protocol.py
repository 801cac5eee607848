"""The executor: what the engine calls to run its steps, whatever runs them.

Two implementations: `ModelRunner` (engine/worker/runner.py), the whole model in this process, and
`TensorParallelExecutor` (engine/worker/executor.py), rank 0's runner here and the other ranks in
worker processes. The engine, its core process and the tests see only this protocol; a test
double wraps one to inject faults (tests/faulty_executor.py). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from kvserve.engine.core.step_record import GrammarBitmask, StepRecord
    from kvserve.engine.worker.runner import RunnerOutput
    from kvserve.models.attention.layer import Attention, AttentionBackend
    from kvserve.models.quantization import QuantizationReport


@runtime_checkable
class Executor(Protocol):
    """Runs the engine's steps on the model: loaded and its KV pool allocated once constructed."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def num_kv_blocks(self) -> int:
        """The KV pool's blocks, the null block included (the same on every rank)."""
        ...

    @property
    def attn_backend(self) -> AttentionBackend: ...

    @property
    def attn_layers(self) -> list[Attention]:
        """This process's attention layers (each holds its share of the KV pool)."""
        ...

    @property
    def has_cuda_graphs(self) -> bool:
        """Decode steps replay captured CUDA graphs."""
        ...

    @property
    def weights_report(self) -> QuantizationReport:
        """What the weights are held as, and their bytes (rank 0's shard under tensor parallelism)."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why no later step can run (a tensor-parallel worker died); None while steps can run."""
        ...

    def execute(
        self, step: StepRecord, grammar_bitmask: Callable[[], GrammarBitmask | None] | None = None
    ) -> RunnerOutput:
        """Run one step; outputs follow `step.req_ids`. `grammar_bitmask` is called once the
        forward is launched (None: nothing is constrained)."""
        ...

    def warm_up(self) -> bool:
        """Pay the first step's one-time costs before any request does; False where it cannot
        (nothing ran)."""
        ...

    def shutdown(self) -> None:
        """Release what the executor started (worker processes); idempotent."""
        ...


# wraps an executor in another (tests: a double that fails chosen steps); picklable to cross to the core
ExecutorWrapper = Callable[[Executor], Executor]

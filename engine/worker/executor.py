"""The tensor-parallel executor: rank 0 in this process, ranks 1..N-1 in worker processes.

Rank 0 is the ordinary `ModelRunner` holding its shard: the engine schedules, rank 0 runs
the forward with the workers and samples. Each step, before running it, rank 0 sends every
worker a `WorkerStep` (the record and the sampled ids of the previous step) over its own
pipe: plain data, a few hundred bytes for a decode step (a shared-memory ring
was no faster: docs/performance.md). Workers are spawned (one per
device: cuda:rank on CUDA with NCCL, the CPU with gloo and the cores split between ranks).

LoRA adapters (docs/lora.md, models/lora.py for how each rank holds its part) are read on every rank
before a request uses them: `add_lora` reads rank 0's part, then asks each worker for its own
(`WorkerAddLoRA`, answered between steps); if any rank refuses, the ranks that read it forget it
again and the `ValueError` names the rank, so no adapter is ever half-loaded. `remove_lora` tells
every rank.

Failure is all-or-nothing: the ranks meet in a collective several times a step, so a rank
that fails mid-step would leave the others matching the wrong collectives. Any error on rank
0 during a step, a collective timing out (`timeout_s`, a hung worker) or a worker exiting
marks the executor dead: the step raises `TensorParallelError`, every later step raises it
at once, and `dead_reason` says why (the engine core polls it, so an idle engine notices a
dead worker within a second). Workers exit on their own when rank 0's process goes away
(their pipe closes), so none outlives it.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch

from kvserve.engine import messages
from kvserve.engine.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from kvserve.engine.core.step_record import GrammarBitmask, StepRecord
from kvserve.engine.errors import TensorParallelError
from kvserve.engine.messages import (
    StartFailed,
    Stop,
    WorkerAddLoRA,
    WorkerLoaded,
    WorkerLoRAResult,
    WorkerRemoveLoRA,
    WorkerStep,
)
from kvserve.engine.processes import wait_for_exit
from kvserve.engine.worker.device import resolve_device
from kvserve.engine.worker.runner import ModelRunner, RunnerOutput
from kvserve.engine.worker.tp_worker import WorkerArgs, run_worker
from kvserve.models.parallel import ParallelState, new_group

if TYPE_CHECKING:
    from kvserve.models.attention.layer import Attention, AttentionBackend
    from kvserve.models.quantization import QuantizationReport

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0  # the longest a collective waits for a rank (a hung worker)
_STOP_TIMEOUT_S = 5.0
_START_TIMEOUT_S = 3600.0  # loading a shard may take long; a worker that dies ends the wait at once
_EXIT_WAIT_S = (
    5.0  # after a failed step: how long a worker that is exiting gets to be named as the cause
)


def rank_devices(device: torch.device, size: int) -> list[str]:
    """The device of each rank: all on the CPU, or consecutive GPUs from `device`'s index."""
    if device.type == "cpu":
        return ["cpu"] * size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size={size} needs GPUs {first}..{first + size - 1}, "
            f"but {count} are visible"
        )
    return [f"cuda:{first + r}" for r in range(size)]


def threads_per_rank(size: int) -> int:
    """The CPU cores this process may use, split evenly between the ranks (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // size)


class TensorParallelExecutor:
    """Runs steps on `size` ranks: an `Executor` (engine/worker/executor_protocol.py) whose model facts
    (device, dtype, KV pool, attention backend, weights) are rank 0's runner's."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        model_path: str,
        hf_config: Any,
        max_model_len: int,
        size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        import torch.distributed as dist

        self.size, self.timeout_s = size, timeout_s
        self._dead: str | None = None
        self._prev_sampled: tuple[int | None, ...] = ()
        self._prev_num_accepted: tuple[int, ...] = ()
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._conns = []
        devices = rank_devices(resolve_device(model_config.device), size)
        self._num_threads = threads_per_rank(size) if devices[0] == "cpu" else None
        self._saved_threads = torch.get_num_threads()
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            size,
            True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, size):
                args = WorkerArgs(
                    rank=rank,
                    size=size,
                    store_port=self._store.port,
                    device=devices[rank],
                    num_threads=self._num_threads,
                    timeout_s=timeout_s,
                    model_config=model_config,
                    cache_config=cache_config,
                    scheduler_config=scheduler_config,
                    model_path=model_path,
                    hf_config=hf_config,
                    max_model_len=max_model_len,
                    log_level=logging.getLogger().level,
                    lora_config=lora_config,
                )
                conn, child_conn = ctx.Pipe(duplex=True)
                process = ctx.Process(
                    target=run_worker,
                    args=(args, child_conn),
                    name=f"kvserve-tp{rank}",
                    daemon=True,
                )
                process.start()
                child_conn.close()  # so that the worker's end closing is seen here as EOF
                self._workers.append(process)
                self._conns.append(conn)
            if self._num_threads is not None:
                torch.set_num_threads(self._num_threads)
            self.parallel = ParallelState(0, size, torch.device(devices[0]))
            self.driver = ModelRunner(
                replace(model_config, device=devices[0]),
                cache_config,
                scheduler_config,
                model_path,
                hf_config,
                max_model_len,
                self.parallel,
                self._join_group,
                lora_config=lora_config,
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallelism: %d ranks on %s (worker pids %s)",
            size,
            ", ".join(devices),
            [p.pid for p in self._workers],
        )

    def _join_group(self) -> None:
        """Wait for every worker to load its shard (raising what a failed one reports), then connect."""
        waiting = dict(zip(self._conns, self._workers))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while waiting:
            ready = wait([*waiting, *(p.sentinel for p in waiting.values())], timeout=5.0)
            for conn, process in list(waiting.items()):
                if conn in ready:
                    try:
                        message = messages.decode(conn.recv_bytes())
                    except (EOFError, OSError):
                        message = None
                    if not isinstance(message, WorkerLoaded):
                        why = (
                            message.text
                            if isinstance(message, StartFailed)
                            else "exited without a word"
                            if message is None
                            else type(message).__name__
                        )
                        raise TensorParallelError(
                            f"tensor-parallel worker {process.name} failed to start: {why}"
                        )
                    del waiting[conn]
                elif process.sentinel in ready:
                    raise TensorParallelError(
                        f"tensor-parallel worker {process.name} exited with code "
                        f"{process.exitcode} while loading"
                    )
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel workers did not load in {_START_TIMEOUT_S:.0f} s"
                )
        assert self.parallel.device is not None  # set with the state above
        self.parallel.group = new_group(
            self._store, 0, self.size, self.parallel.device, self.timeout_s
        )

    # ---- what the engine reads: rank 0's ----------------------------------
    @property
    def device(self) -> torch.device:
        return self.driver.device

    @property
    def dtype(self) -> torch.dtype:
        return self.driver.dtype

    @property
    def num_kv_blocks(self) -> int:
        return self.driver.num_kv_blocks

    @property
    def attn_backend(self) -> AttentionBackend:
        return self.driver.attn_backend

    @property
    def attn_layers(self) -> list[Attention]:
        return self.driver.attn_layers

    @property
    def has_cuda_graphs(self) -> bool:
        return self.driver.has_cuda_graphs

    @property
    def weights_report(self) -> QuantizationReport:
        return self.driver.weights_report

    def warm_up(self) -> bool:
        """Nothing: rank 0's warm-up step alone would wait for the other ranks forever."""
        return False

    # ---- LoRA adapters: on every rank or on none -------------------------------
    def add_lora(self, lora_id: int, name: str, path: str, in_use: tuple[int, ...] = ()) -> None:
        """Read adapter `lora_id` on every rank (ValueError naming the rank that refused it; then
        no rank keeps it); `in_use` as `ModelRunner.add_lora`'s."""
        reason = self.dead_reason
        if reason is not None:
            raise TensorParallelError(reason)
        is_new = not self.driver.has_lora(lora_id)
        self.driver.add_lora(lora_id, name, path, in_use)  # rank 0 first: most refusals stop here
        if not is_new:
            return  # every rank has it (one dropped from host memory re-reads it when needed)
        message = messages.encode(
            WorkerAddLoRA(lora_id=lora_id, name=name, path=path, in_use=in_use)
        )
        errors = []
        for rank, (conn, process) in enumerate(zip(self._conns, self._workers), start=1):
            try:
                conn.send_bytes(message)
            except OSError as e:  # the worker is gone
                reason = self._fail(f"tensor-parallel worker {process.name}: {e}")
                raise TensorParallelError(reason) from e
            error = self._lora_reply(conn, process)
            if error is not None:
                errors.append(f"tensor-parallel rank {rank}: {error}")
        if errors:
            self.remove_lora(lora_id)
            raise ValueError(f"LoRA adapter {name!r} at {path!r} refused on {'; '.join(errors)}")

    def _lora_reply(
        self, conn: Connection, process: multiprocessing.process.BaseProcess
    ) -> str | None:
        """A worker's answer to `WorkerAddLoRA`: None, or why it refused; a worker that exits or
        stays silent past `timeout_s` kills the executor."""
        ready = wait([conn, process.sentinel], timeout=self.timeout_s)
        if conn in ready:
            try:
                reply = messages.decode(conn.recv_bytes())
            except (EOFError, OSError):
                reply = None
            if isinstance(reply, WorkerLoRAResult):
                return reply.error
        raise TensorParallelError(
            self._fail(f"tensor-parallel worker {process.name} did not answer a LoRA load")
        )

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id` on every rank; False if rank 0 did not have it."""
        message = messages.encode(WorkerRemoveLoRA(lora_id=lora_id))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:  # the worker is gone: `dead_reason` says so from now on
                pass
        return self.driver.remove_lora(lora_id)

    # ---- one step ----------------------------------------------------------
    def execute(
        self, step: StepRecord, grammar_bitmask: Callable[[], GrammarBitmask | None] | None = None
    ) -> RunnerOutput:
        """Send the step to every worker, run rank 0's part (which samples); any failure is fatal."""
        reason = self.dead_reason
        if reason is not None:
            raise TensorParallelError(reason)
        try:
            message = messages.encode(
                WorkerStep(
                    record=step,
                    prev_sampled_token_ids=self._prev_sampled,
                    prev_num_accepted=self._prev_num_accepted,
                )
            )
            for conn in self._conns:
                conn.send_bytes(message)
            out = self.driver.execute(step, grammar_bitmask)
        except BaseException as e:
            reason = self._fail(
                f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e})"
            )
            raise TensorParallelError(reason) from e
        self._prev_sampled = tuple(out.sampled_token_ids)
        self._prev_num_accepted = (
            tuple(len(out.accepted.get(r, ())) for r in step.req_ids) if out.accepted else ()
        )
        return out

    @property
    def dead_reason(self) -> str | None:
        """Why the executor cannot run steps (a worker exited, a step failed); None while it can."""
        if self._dead is None:
            exited = [p for p in self._workers if not p.is_alive()]
            if exited:
                self._fail()
        return self._dead

    def _fail(self, cause: str | None = None) -> str:
        """Mark the executor dead (the first reason sticks) and stop the workers; returns the reason.
        A worker that exited is named, with its exit code, ahead of the error it caused on rank 0."""
        if self._dead is None:
            if (
                cause is not None
            ):  # a worker killed mid-step: its exit may trail rank 0's error (the
                # OS tears its memory down first, which took over a second on a loaded 2-core machine)
                ready = wait([p.sentinel for p in self._workers], timeout=_EXIT_WAIT_S)
                for p in self._workers:
                    if p.sentinel in ready:  # its files close before it can be reaped: a blocking
                        p.join(_EXIT_WAIT_S)  # wait, so that is_alive() below sees it gone
            exited = [p for p in self._workers if not p.is_alive()]
            if exited:
                p = exited[0]
                code = p.exitcode
                how = (
                    f"signal {signal.Signals(-code).name}"
                    if code is not None and code < 0
                    else f"code {code}"
                )
                self._dead = f"tensor-parallel worker {p.name} (pid {p.pid}) exited with {how}"
            else:
                self._dead = cause or "tensor-parallel executor failed"
            logger.error("engine dead: %s", self._dead)
            self._stop_workers(graceful=False)
        return self._dead

    # ---- shutdown ------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (asked first, then terminated, then killed); idempotent."""
        if self._dead is None:
            self._dead = "the engine was shut down"
        self._stop_workers(graceful=True)
        if self._num_threads is not None:
            torch.set_num_threads(self._saved_threads)

    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            for conn in self._conns:
                try:
                    conn.send_bytes(messages.encode(Stop()))
                except OSError:
                    pass
        deadline = time.monotonic() + (_STOP_TIMEOUT_S if graceful else 0.0)
        for process in self._workers:
            wait_for_exit(process, deadline - time.monotonic())
        for conn in self._conns:
            conn.close()
        self._conns = []
        if hasattr(self, "parallel"):
            self.parallel.group = None

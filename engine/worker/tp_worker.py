"""A tensor-parallel worker process: ranks 1..N-1, each with its shard of the model and its own
KV pool, driven step by step by rank 0 (engine/worker/executor.py).

A worker never sees a `Request`, never schedules and never samples. Over its pipe it gets
one message per step, a `WorkerStep` (the `StepRecord` and the sampled ids of the previous
step, engine/messages.py): the record
is the same plain data rank 0's runner gets, and the previous step's sampled ids are the
only tokens the worker cannot know (rank 0 sampled them); it appends them to its own copy
of the sequences, then runs the same forward as rank 0, meeting it in every collective
(the all-reduces, and the LM head's gather for the sampled and prompt-logprob rows).

LoRA adapters (docs/lora.md) reach it between steps: `WorkerAddLoRA` reads this rank's part of an
adapter and answers `WorkerLoRAResult` (rank 0 undoes the load everywhere if any rank refused it),
`WorkerRemoveLoRA` forgets one. An adapter a step needs but this rank has dropped from host memory
is re-read from its directory, as on rank 0.

Start-up: load the shard, send `WorkerLoaded`, join the process group. A failure before that
is sent as `StartFailed` (the error's type, message and traceback). A worker exits when told
(`Stop`), when its pipe closes (rank 0's process is gone, even SIGKILLed), or when a step
fails (a collective timing out or a peer vanishing included): rank 0 sees the exit and
declares the engine dead. It ignores SIGINT:
a Ctrl-C reaches the whole process group, and rank 0 decides when workers stop.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import numpy as np
import torch

from kvserve.engine import messages
from kvserve.engine.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from kvserve.engine.core.step_record import StepRecord
from kvserve.engine.messages import (
    StartFailed,
    WorkerAddLoRA,
    WorkerLoaded,
    WorkerLoRAResult,
    WorkerRemoveLoRA,
    WorkerStep,
)
from kvserve.engine.worker.runner import ModelRunner
from kvserve.models.parallel import ParallelState, new_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    rank: int
    size: int
    store_port: int  # rank 0's TCPStore on 127.0.0.1
    device: str  # "cpu" or "cuda:N"
    num_threads: int | None  # torch intra-op threads (CPU: the cores split between ranks)
    timeout_s: float  # bounds every collective
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    model_path: str
    hf_config: object
    max_model_len: int
    log_level: int
    lora_config: LoRAConfig | None = None


class WorkerRunner(ModelRunner):
    """The runner of a rank > 0: rank 0's batch bookkeeping and forward, without sampling."""

    @torch.inference_mode()
    def execute_worker(
        self,
        step: StepRecord,
        prev_sampled: tuple[int | None, ...],
        prev_num_accepted: tuple[int, ...] = (),
    ) -> None:
        """Append the tokens rank 0 sampled last step (rows are still that step's): the drafts it
        accepted (already in this batch's token ids, after the rows' tokens) and its sampled token;
        then run this step."""
        if prev_num_accepted:
            self.batch.num_tokens[: len(prev_num_accepted)] += np.array(prev_num_accepted, np.int64)
        rows = [i for i, token in enumerate(prev_sampled) if token is not None]
        if rows:
            token_ids = np.array([prev_sampled[i] for i in rows], np.int64)
            self.batch.append_sampled(
                np.array(rows, np.int64), token_ids, None, None
            )  # no penalty state here
        hidden, _, _, prompt_rows, _, owners, _ = self._forward(
            step
        )  # (the LM head ran on rank 0's rows too)
        if owners:  # rank 0 scores prompt logprobs in chunks: one LM-head gather each
            chunk = self.max_num_seqs
            for i in range(0, len(prompt_rows), chunk):
                self.model.compute_logits(hidden[self._to_device(prompt_rows[i : i + chunk])])


def run_worker(args: WorkerArgs, conn: Connection) -> None:
    """Process entry point (spawned by the executor)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {args.rank}]: %(message)s",
    )
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    parallel = ParallelState(args.rank, args.size, device)

    def join_group() -> None:
        conn.send_bytes(messages.encode(WorkerLoaded()))
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1",
            args.store_port,
            args.size,
            False,
            timeout=datetime.timedelta(seconds=args.timeout_s),
        )
        parallel.group = new_group(store, args.rank, args.size, device, args.timeout_s)

    try:
        runner = WorkerRunner(
            replace(args.model_config, device=args.device),
            args.cache_config,
            args.scheduler_config,
            args.model_path,
            args.hf_config,
            args.max_model_len,
            parallel,
            join_group,
            lora_config=args.lora_config,
        )
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
        logger.exception("tensor-parallel worker start-up failed")
        try:
            conn.send_bytes(messages.encode(StartFailed.from_exception(e)))
        except OSError:
            pass
        os._exit(1)
    code = _serve(runner, conn, args.rank)
    logging.shutdown()
    os._exit(code)  # skip interpreter teardown (torch's thread pools, the process group)


def _serve(runner: WorkerRunner, conn: Connection, rank: int) -> int:
    while True:
        try:
            message = messages.decode(conn.recv_bytes())
        except (EOFError, OSError):
            logger.warning("rank 0 closed the pipe; tensor-parallel worker %d exiting", rank)
            return 0
        if isinstance(message, WorkerAddLoRA):
            try:
                runner.add_lora(message.lora_id, message.name, message.path, message.in_use)
                reply = WorkerLoRAResult()
            except Exception as e:  # noqa: BLE001 - a refused adapter: rank 0 raises it
                reply = WorkerLoRAResult(f"{type(e).__name__}: {e}")
            try:
                conn.send_bytes(messages.encode(reply))
            except OSError:  # rank 0 is gone
                return 0
            continue
        if isinstance(message, WorkerRemoveLoRA):
            runner.remove_lora(message.lora_id)
            continue
        if not isinstance(message, WorkerStep):  # Stop
            return 0
        try:
            runner.execute_worker(
                message.record, message.prev_sampled_token_ids, message.prev_num_accepted
            )
        except Exception:  # a collective timed out, a peer vanished, or the step itself failed
            logger.exception("tensor-parallel worker %d: step failed; exiting", rank)
            return 1

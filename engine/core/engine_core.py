"""The engine core process: owns the LLMEngine and runs the step loop, nothing else.

`AsyncLLM` (the server's side) starts this with `multiprocessing`'s spawn context and
talks to it over one duplex pipe (a Unix socket pair) with typed messages, one per command
and one per step (see `engine.messages`). Running the loop in its own
process means it never waits for the GIL that the event loop, uvicorn and JSON
encoding hold in the server process.

Two threads: the main thread drains commands, runs `LLMEngine.step_deltas()` and sends
each step's message itself (a few KB; an output thread measured no better and adds a GIL
hand-off per step); an input thread receives and decodes commands into a queue, so a
large prompt arriving never stalls a step.

The core ignores SIGINT and SIGTERM: a Ctrl-C or a service manager signals the whole
process group, and the server must be able to drain its streams first. It stops when
told (`stop`), or when the pipe closes because the server process is gone (then it
exits at once, so nothing is left behind even after a SIGKILL of the server).

A step that raises fails only its own requests; `max_consecutive_step_failures` failed
steps in a row (a sticky device error) mean the engine is dead: the core sends DEAD and
exits with code 1.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvserve.engine import messages
from kvserve.engine.config import EngineArgs
from kvserve.engine.errors import EngineOverloadedError, StepFailed
from kvserve.engine.messages import (
    AbortRequest,
    AddRequest,
    Dead,
    Overloaded,
    Ready,
    Rejected,
    StartFailed,
    Stats,
    StepFailedRequests,
    StepOutputs,
    Stop,
)
from kvserve.engine.worker.executor_protocol import Executor, ExecutorWrapper
from kvserve.models.heap import release_free_memory

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the inbox before looking again
_EXIT_GRACE_S = (
    5.0  # after the server vanished, how long a running step may take before we exit anyway
)


class EngineDied(RuntimeError):
    """Too many consecutive steps failed: the engine is treated as broken."""


def run_engine_core(
    args: EngineArgs,
    conn: Connection,
    log_level: int,
    executor_wrapper: ExecutorWrapper | None = None,
) -> None:
    """Process entry point (spawned by `AsyncLLM`). `executor_wrapper`, if given, wraps the
    engine's executor once it has warmed up (tests inject faults so)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s"
    )
    try:
        from kvserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(args)
        warm_up(engine.runner)
        if executor_wrapper is not None:
            engine.runner = executor_wrapper(engine.runner)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which raises it
        logger.exception("engine start-up failed")
        conn.send_bytes(messages.encode(StartFailed.from_exception(e)))
        conn.close()
        os._exit(1)
    # What start-up made (the model, the tokenizer, imported modules) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks it in the middle of a step.
    release_free_memory()  # a full collection, then what loading freed goes back to the OS
    gc.freeze()
    conn.send_bytes(messages.encode(Ready(info=engine.info, stats=engine.stats())))
    threading.Thread(
        target=_prefault_when_idle,
        args=(engine.runner.attn_layers,),
        name="kv-prefault",
        daemon=True,
    ).start()
    EngineCore(engine, conn, args.core_config().max_consecutive_step_failures).run()


def warm_up(executor: Executor) -> None:
    """One dummy step before the core reports ready, so that no request pays the first step's
    one-time costs (`Executor.warm_up`)."""
    start = time.perf_counter()
    if executor.warm_up():
        logger.info("engine warm-up step %.2f s", time.perf_counter() - start)


def _prefault_when_idle(layers: Sequence[Any]) -> None:
    """Fault in the KV pool (`engine.worker.kv_pool.prefault`) at the lowest CPU priority: the OS zeroes
    the pages in this thread, which would otherwise take a core from the steps of the first
    requests (Linux: a thread's nice value is its own)."""
    from kvserve.engine.worker.kv_pool import prefault

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        pass
    prefault(layers)


class EngineCore:
    def __init__(
        self, engine: LLMEngine, conn: Connection, max_consecutive_step_failures: int
    ) -> None:
        self.engine = engine
        self.conn = conn
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.is_stopping = False
        self._num_grammars_sent = 0

    def run(self) -> None:
        threading.Thread(target=self._receive, name="core-input", daemon=True).start()
        code = 0
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - any escape means the engine is dead
            logger.exception("engine loop died")
            self._send(Dead(f"engine loop died: {e!r}"))
            code = 1
        try:
            self.engine.shutdown()  # tensor-parallel workers, if any
        except Exception:  # noqa: BLE001 - exiting anyway; workers also exit when this process does
            logger.exception("engine shutdown failed")
        logging.shutdown()
        os._exit(code)  # skip interpreter teardown (torch's thread pools, atexit hooks)

    def _loop(self) -> None:
        engine = self.engine
        while not self.is_stopping:
            dead_reason = engine.dead_reason  # a tensor-parallel worker died, even while idle
            if dead_reason is not None:
                raise EngineDied(dead_reason)
            has_work = engine.has_unfinished_requests()
            changed = self._drain_inbox(block=not has_work)
            if self.is_stopping:
                return
            if not engine.has_unfinished_requests():
                # an abandoned compile may finish while nothing runs: the gauges must see it
                num_grammars = engine.structured.num_jobs
                if changed or num_grammars != self._num_grammars_sent:
                    self._num_grammars_sent = num_grammars
                    self._send(Stats(engine.stats()))
                continue
            self._send(self._step())
            for request_id, message in engine.take_rejected():  # a grammar failed to compile
                self._send(Rejected(request_id, message))

    def _step(self) -> StepOutputs | StepFailedRequests:
        try:
            deltas = self.engine.step_deltas()
        except StepFailed as e:
            logger.exception("step failed; failing its requests: %s", e.request_ids)
            failed = StepFailedRequests(
                request_ids=e.request_ids,
                message=f"internal error: {e.__cause__!r}",
                stats=self.engine.stats(),
            )
            num_failures = self.engine.num_consecutive_step_failures
            if self.engine.dead_reason is not None:  # no later step can succeed
                self._send(failed)
                raise EngineDied(self.engine.dead_reason) from e
            if num_failures >= self.max_consecutive_step_failures:
                self._send(failed)  # these requests get their own step's error; the rest get DEAD
                raise EngineDied(
                    f"{num_failures} consecutive steps failed "
                    f"(max_consecutive_step_failures={self.max_consecutive_step_failures}); "
                    f"the last with {e.__cause__!r}"
                ) from e
            return failed
        return StepOutputs(deltas=deltas, stats=self.engine.stats())

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued command; True if any was applied."""
        try:
            command = self.inbox.get(timeout=_IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._apply(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: messages.Message) -> None:
        match command:
            case AddRequest(request_id, prompt, arrival_time):
                try:
                    self.engine.add_processed(request_id, prompt, arrival_time, build_outputs=False)
                except ValueError as e:
                    self._send(Rejected(request_id, str(e)))
                except EngineOverloadedError as e:
                    self._send(Overloaded(request_id, str(e)))
            case AbortRequest(request_id):
                self.engine.abort_delta(request_id)  # the client has already dropped the stream
            case Stop():
                self.is_stopping = True
            case _:
                raise TypeError(f"the engine core cannot handle {type(command).__name__}")

    # ---- pipe threads --------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                self.inbox.put(messages.decode(self.conn.recv_bytes()))
        except (EOFError, OSError):
            pass
        if not self.is_stopping:  # the server process is gone: nobody will read our outputs
            logger.warning("the server closed the engine pipe; exiting")
            self.is_stopping = True
            self.inbox.put(Stop())
            threading.Timer(_EXIT_GRACE_S, os._exit, (1,)).start()

    def _send(self, message: messages.Message) -> None:
        try:
            self.conn.send_bytes(messages.encode(message))
        except OSError:  # the server is gone; _receive stops the loop
            pass

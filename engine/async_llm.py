"""AsyncLLM: the engine for asyncio servers, with the engine core in a process of its own.

The core process (`engine.core.engine_core`) owns the scheduler, KV cache, runner and detokenizer
and runs the step loop. This side, in the server's process, validates and tokenizes
prompts, sends them over a pipe, and folds the deltas each step sends back into
per-request `RequestOutput`s. It imports no torch.

A reader thread receives the core's messages and hands each step's deltas to the event
loops that own the streams (one `call_soon_threadsafe` per loop per step). A stream
that is not read coalesces what arrives: its memory grows with its output, never with
the number of steps.

If the core process dies (crash, OOM kill, the loop raising), the pipe closes at once:
every open stream fails with `EngineDeadError` and `is_healthy` turns False. So does the
core deciding it is broken (`max_consecutive_step_failures` failed steps in a row). A
request started after that fails at once, never waits for a core that is gone.
`shutdown()` ends the streams still open with `EngineShutDownError`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.engine import messages
from kvserve.engine.config import EngineArgs, RuntimeInfo
from kvserve.engine.errors import EngineDeadError, EngineOverloadedError, EngineShutDownError
from kvserve.engine.input_processor import (
    ProcessedPrompt,
    PromptType,
    load_tokenizer,
    max_chars_per_token,
    process_prompt,
    run_off_loop,
)
from kvserve.engine.lora_request import LoRARequest
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
from kvserve.engine.outputs import EngineStats, RequestDelta, RequestOutput, RequestOutputBuilder
from kvserve.engine.pooling_params import PoolingParams
from kvserve.engine.processes import wait_for_exit
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.structured_output.limits import check_limits
from kvserve.models import built_default_model
from kvserve.models.heap import release_free_memory

if TYPE_CHECKING:
    from kvserve.engine.worker.executor_protocol import ExecutorWrapper

logger = logging.getLogger(__name__)

_START_POLL_S = 0.1
_STOP_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Stream:
    """One request's state on the event loop's side (touched only in its loop's thread)."""

    loop: asyncio.AbstractEventLoop
    builder: RequestOutputBuilder
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None


class AsyncLLM:
    def __init__(
        self, args: EngineArgs, wait: bool = True, executor_wrapper: ExecutorWrapper | None = None
    ) -> None:
        """Start the engine core process. With `wait=False` this returns at once (the core
        loads while the caller does other start-up work); call `wait_ready()` before use.
        After `args.max_consecutive_step_failures` failed steps in a row the core declares itself dead.
        `executor_wrapper` (picklable) wraps the core's executor once it has warmed up: a test
        double's hook (faults on chosen steps)."""
        args.validate()
        self._args = args
        self._grammar_limits = args.structured_outputs_config().limits
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=_core_main,
            name="kvserve-core",
            args=(args, child_conn, logging.getLogger().level, executor_wrapper),
        )
        self._process.start()
        child_conn.close()
        atexit.register(self._kill_core)
        # a local tokenizer loads while the core starts (both mostly import modules: two cores);
        # not from a directory of GGUF files: which file is the checkpoint is the core's to resolve
        local_path = args.tokenizer or args.model or built_default_model()
        self._early_tokenizer = None
        if local_path and os.path.isdir(local_path) and not any(Path(local_path).glob("*.gguf")):
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
            self._early_tokenizer = pool.submit(load_tokenizer, local_path)
            pool.shutdown(wait=False)
        self._streams: dict[str, _Stream] = {}
        self._send_lock = threading.Lock()
        self._error: BaseException | None = None
        self._is_stopping = False
        self._is_ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the core has loaded the model (raises what its start-up raised)."""
        if self._is_ready:
            return
        try:
            self.info, self._stats = self._receive_ready()
            early = self._early_tokenizer
            self.tokenizer = (
                early.result()
                if early
                else load_tokenizer(self._args.tokenizer or self.info.model_path)
            )
        except BaseException:
            self._kill_core()
            raise
        self.chat_template: str | None = getattr(self.tokenizer, "chat_template", None)
        self._max_chars_per_token = max_chars_per_token(self.tokenizer)
        release_free_memory()  # what loading the tokenizer freed (its parsed files) goes back to the OS
        self._reader = threading.Thread(target=self._read, name="kvserve-core-reader", daemon=True)
        self._reader.start()
        self._is_ready = True
        logger.info("engine core running in process %d", self._process.pid)

    def _receive_ready(self) -> tuple[RuntimeInfo, EngineStats]:
        while not self._conn.poll(_START_POLL_S):
            if not self._process.is_alive():
                raise EngineDeadError(
                    f"the engine core exited with code {self._process.exitcode} while starting"
                )
        match messages.decode(self._conn.recv_bytes()):
            case Ready(info, stats):
                return info, stats
            case StartFailed() as failed:
                raise failed.to_exception()
            case other:
                raise EngineDeadError(
                    f"the engine core sent {type(other).__name__} instead of Ready"
                )

    @property
    def model_config(self) -> RuntimeInfo:
        return self.info

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    @property
    def is_healthy(self) -> bool:
        return (
            self._is_ready
            and self._error is None
            and not self._is_stopping
            and self._process.is_alive()
        )

    @property
    def error(self) -> BaseException | None:
        """Why the engine died; None while it runs and after a requested `shutdown()`."""
        return self._error

    def stats(self) -> EngineStats:
        """The snapshot the core sent with its latest step (or command)."""
        return self._stats

    # ---- asyncio side ------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield this request's outputs as steps produce them; the last has finished=True.

        `prompt` is text, token ids, or a dict `{"prompt": text}` / `{"prompt_token_ids": [...]}`
        with an optional `"cache_salt"` (only requests with the same salt share cached KV).

        With `PoolingParams` it is an embedding request: one output, its `embedding` set.
        `lora_request`: the LoRA adapter to run with (the engine needs enable_lora; docs/lora.md).

        Raises ValueError for bad input before yielding (a bad adapter: when the core reads it). Leaving the loop early
        (client gone, task cancelled) aborts the request and frees its KV blocks.
        Outputs that arrive while the consumer is busy are merged into one.
        """
        if not self.is_healthy:
            raise self._not_running() from self._error
        # big prompts are tokenized (and token ids checked) in a worker thread, off this loop
        inner = (
            prompt.get("prompt", prompt.get("prompt_token_ids"))
            if isinstance(prompt, dict)
            else prompt
        )
        size = (
            len(inner)
            if isinstance(inner, str)
            else len(inner) // 8
            if isinstance(inner, Sequence)
            else None
        )
        processed = await run_off_loop(self._check_prompt, prompt, params, num_chars=size)
        if lora_request is not None:
            processed = replace(processed, lora_request=lora_request)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = time.monotonic()
        builder = processed.output_builder(request_id, arrival)
        stream = _Stream(asyncio.get_running_loop(), builder)
        self._streams[request_id] = stream
        is_finished = False
        try:
            if (
                not self.is_healthy
            ):  # it died after the check above, maybe after failing every stream
                is_finished = True
                raise self._not_running() from self._error
            self._send(AddRequest(request_id=request_id, prompt=processed, arrival_time=arrival))
            while not is_finished:
                if not builder.has_news and stream.error is None:
                    await stream.wakeup.wait()
                    stream.wakeup.clear()
                if builder.has_news:
                    out = builder.output()
                    is_finished = out.finished
                    yield out
                elif stream.error is not None:
                    is_finished = True  # the core has already dropped it
                    raise stream.error
        finally:
            self._streams.pop(request_id, None)
            if not is_finished:
                self._abort_now(request_id)

    def _check_prompt(
        self, prompt: PromptType, params: SamplingParams | PoolingParams
    ) -> ProcessedPrompt:
        processed = process_prompt(
            self.tokenizer, self.info, prompt, params, self._max_chars_per_token
        )
        if (
            processed.pooling is None
            and isinstance(params, SamplingParams)
            and params.structured_outputs is not None
        ):  # here, so that the core never walks an oversized schema
            check_limits(params.structured_outputs, self._grammar_limits)
        return processed

    def _not_running(self) -> EngineDeadError:
        if self._is_stopping and self._error is None:
            return EngineShutDownError("the engine was shut down")
        return EngineDeadError("the engine is not running")

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        if self.is_healthy:
            try:
                self._send(AbortRequest(request_id))
            except EngineDeadError:
                pass  # nothing left to abort

    async def shutdown(self) -> None:
        """Stop the core (it finishes its current step) and wait for the process to exit."""
        if self._is_stopping:
            return
        self._is_stopping = True
        try:
            self._send(Stop())
        except EngineDeadError:
            pass
        if self._is_ready:  # open streams end now, not after the core's current step
            self._fail_all(EngineShutDownError("the engine was shut down"))
        await asyncio.to_thread(wait_for_exit, self._process, _STOP_TIMEOUT_S)
        self._conn.close()

    def _send(self, message: messages.Message) -> None:
        data = messages.encode(message)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as e:  # the core died between the health check and this write
            raise EngineDeadError("the engine core process is gone") from e

    def _kill_core(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(2.0)

    # ---- reader thread -----------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = messages.decode(self._conn.recv_bytes())
                if not self._dispatch(message):
                    break
        except (EOFError, OSError):
            if not self._is_stopping:
                self._process.join(1.0)
                self._error = EngineDeadError(
                    f"the engine core process exited (code {self._process.exitcode})"
                )
        if self._error is not None:
            logger.error("%s", self._error)
        self._fail_all(self._error or EngineShutDownError("the engine was shut down"))

    def _dispatch(self, message: messages.Message) -> bool:
        """Route one message from the core; False when the core is dead."""
        match message:
            case StepOutputs(deltas, stats):
                self._stats = stats
                self._route([(d.request_id, d) for d in deltas])
            case Stats(stats):
                self._stats = stats
            case Rejected(request_id, text):
                self._route([(request_id, ValueError(text))])
            case Overloaded(request_id, text):
                self._route([(request_id, EngineOverloadedError(text))])
            case StepFailedRequests(request_ids, text, stats):
                self._stats = stats
                self._route([(rid, RuntimeError(text)) for rid in request_ids])
            case Dead(text):
                self._error = EngineDeadError(text)
                return False
            case _:  # a bug on one side of the pipe: nothing after it can be trusted
                self._error = EngineDeadError(
                    f"the engine core sent an unknown message: {type(message).__name__}"
                )
                return False
        return True

    def _fail_all(self, error: BaseException) -> None:
        self._route([(rid, error) for rid in list(self._streams)])

    def _route(self, items: list[tuple[str, RequestDelta | BaseException]]) -> None:
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[_Stream, RequestDelta | BaseException]]
        ] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that loop is closed
                pass


def _deliver(batch: list[tuple[_Stream, RequestDelta | BaseException]]) -> None:
    for stream, item in batch:
        if isinstance(item, BaseException):
            stream.error = (
                stream.error or item
            )  # a request's own step error outlives DEAD's that follows
        else:
            stream.builder.add(item)
        stream.wakeup.set()


def _core_main(
    args: EngineArgs, conn: Connection, log_level: int, executor_wrapper: ExecutorWrapper | None
) -> None:
    from kvserve.engine.core.engine_core import run_engine_core

    run_engine_core(args, conn, log_level, executor_wrapper)

"""AsyncLLM: the engine for asyncio servers.

One background thread owns the LLMEngine and runs its step loop; PyTorch releases
the GIL in its kernels, so the event loop stays responsive while a step runs.
The event loop talks to the thread through an inbox (add / abort commands); the
thread hands each step's outputs back with one `call_soon_threadsafe` per step,
which routes them into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine, StepFailed
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop stopped on an unrecoverable error; the engine serves no more requests."""


class AsyncLLM:
    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLMEngine(args)
        self.tokenizer = self.engine.tokenizer
        self.chat_template = self.engine.chat_template
        self.info = self.engine.info
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def model_config(self):
        return self.info

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- asyncio side ------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as steps produce them; the last has finished=True.

        Raises ValueError for bad input before yielding. Leaving the loop early
        (client gone, task cancelled) aborts the request and frees its KV blocks.
        """
        if not self.is_healthy:
            raise EngineDeadError("the engine is not running") from self._error
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.engine.process_prompt(prompt, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", request_id, processed, time.monotonic()))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(("stop",))
        await asyncio.to_thread(self._thread.join, 10)

    # ---- engine thread -----------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox(block=not engine.has_unfinished_requests())
                if self._stopping or not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except StepFailed as e:
                    logger.exception("step failed; failing its requests: %s", e.request_ids)
                    self._deliver([(rid, RuntimeError(f"internal error: {e.__cause__!r}"))
                                   for rid in e.request_ids])
                    continue
                self._deliver([(out.request_id, out) for out in outputs])
        except BaseException as e:  # noqa: BLE001 - any escape means the engine is dead
            logger.exception("engine loop died")
            self._error = e
            self._deliver([(rid, EngineDeadError(f"engine loop died: {e!r}")) for rid in list(self._streams)])

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, processed, arrival = command
            if request_id not in self._streams:
                return  # the client left before the engine saw it
            try:
                self.engine.add_processed(request_id, processed, arrival)
            except ValueError as e:
                self._deliver([(request_id, e)])
        elif kind == "abort":
            self.engine.abort(command[1])
        elif kind == "stop":
            self._stopping = True

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            entry = self._streams.get(request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop is closed
                pass


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in batch:
        stream.put_nowait(item)

"""The grammar compile threads: a bounded set of low-priority threads fed from a queue.

Why threads in the core process, not a killable child process: a compiled grammar must end up
in the core (its matchers run there every step), and xgrammar 0.2.8's only way to move one
between processes is `serialize_json`, which for a large tool set costs far more than the
compile itself (docs/security.md, "Grammar work"). Its compile cannot be interrupted either.
So a compile, once started, runs to its end; what this module makes sure of instead:

- the threads run at a low CPU priority (Linux nice `COMPILE_NICE`; xgrammar's own compile
  threads, created by the compiling thread, inherit it), so a compile beside a busy step loop
  gets a small share of a core instead of half of it; the compile releases the GIL while it
  works, so the step loop never waits for it. Not the lowest priority (19): beside two busy
  threads at nice 0 that share is too small for the largest allowed grammar to compile within
  the time limit (docs/security.md, "Grammar work");
- a queued job that nobody waits for any more is cancelled before it starts (`cancel`);
- a running job that nobody waits for is abandoned: its thread finishes it (the result is
  cached for a later request with the same spec) and exits, and a new thread takes its place,
  so the jobs queued behind it do not wait. At most `num_threads` abandoned jobs run at once;
  beyond that a job is not abandoned and the queue waits for it (the input limits bound how
  long any one compile can take).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_IDLE_EXIT_S = 30.0  # an idle compile thread exits after this long (a new one starts on demand)
COMPILE_NICE = (
    10  # a tenth of a nice-0 thread's CPU share when they compete (CFS weights 110 vs 1024)
)


@dataclass(slots=True, eq=False)
class CompileJob:
    """One spec's compile. `num_waiters` (requests waiting for it) is touched by the engine's thread only."""

    key: str
    spec: Any
    future: Future[Any] = field(default_factory=Future)
    num_waiters: int = 0
    elapsed_s: float = 0.0  # the compile's own time, set by the thread that ran it
    is_abandoned: bool = False


class CompilePool:
    """Runs `compile_fn(spec)` for submitted jobs on up to `num_threads` threads (plus the ones
    finishing abandoned jobs)."""

    def __init__(
        self, compile_fn: Callable[[Any], Any], num_threads: int, nice: int = COMPILE_NICE
    ) -> None:
        self.compile_fn = compile_fn
        self.num_threads = num_threads
        self.nice = nice
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._num_live = 0  # threads alive, abandoned ones included
        self._num_idle = 0
        self._num_abandoned = 0  # threads finishing an abandoned job

    def submit(self, job: CompileJob) -> None:
        with self._cond:
            self._queue.append(job)
            if self._num_idle > 0:
                self._cond.notify()
            else:
                self._start_thread_if_allowed()

    def cancel(self, job: CompileJob) -> None:
        """Nobody waits for `job` any more: drop it if queued, abandon it if running."""
        if job.future.cancel():  # still queued: the thread that pops it skips it
            with self._cond:
                try:
                    self._queue.remove(job)
                except ValueError:
                    pass
            return
        with self._cond:
            if job.future.done() or job.is_abandoned or self._num_abandoned >= self.num_threads:
                return
            job.is_abandoned = True
            self._num_abandoned += 1
            logger.info(
                "grammar compile abandoned (nobody waits for it); it finishes at low priority"
            )
            if self._queue and self._num_idle == 0:
                self._start_thread_if_allowed()

    @property
    def num_threads_alive(self) -> int:
        with self._cond:
            return self._num_live

    def _start_thread_if_allowed(self) -> None:
        # caller holds the lock
        if self._num_live - self._num_abandoned < self.num_threads:
            self._num_live += 1
            threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()

    def _work(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            pass
        while True:
            with self._cond:
                while not self._queue:
                    self._num_idle += 1
                    has_work = self._cond.wait(_IDLE_EXIT_S)
                    self._num_idle -= 1
                    if not has_work and not self._queue:
                        self._num_live -= 1
                        return
                job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                result = self.compile_fn(job.spec)
            except BaseException as e:  # noqa: BLE001 - reported to the requests waiting for it
                job.elapsed_s = time.perf_counter() - start
                job.future.set_exception(e)
            else:
                job.elapsed_s = time.perf_counter() - start
                job.future.set_result(result)
            with self._cond:
                if job.is_abandoned:  # a new thread has taken this one's place
                    self._num_abandoned -= 1
                    self._num_live -= 1
                    return

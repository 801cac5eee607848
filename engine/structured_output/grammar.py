"""Structured outputs: the spec a request asks for, its grammar (compiled once, off the step loop)
and one matcher per sequence that advances with every accepted token.

The library is xgrammar (docs/structured_outputs.md says why, with the numbers). It is an
optional dependency (`pip install kvserve[structured]`), imported only when a constrained
request arrives, so `engine` imports without it and unconstrained serving never touches it.

Life of a constrained request (all in the engine core process):
0. The spec's size was checked against `GrammarLimits` before (engine/structured_output/limits.py:
   `LLMEngine.process_prompt`, `AsyncLLM.generate`, the server's validation).
1. `StructuredOutputManager.add` queues the spec for the compile threads
   (engine/structured_output/compile_threads.py); the compiled grammar is cached by the spec's canonical key
   (LRU), so equal specs compile once, and a compile running for one request is shared by the
   others that ask for the same spec. The request is held here, not in the scheduler, so a
   slow compile stalls nobody.
2. `take_ready` hands the scheduler the requests whose grammar is ready, each sequence with
   its own `SequenceGrammar` (its matcher); a failed compile, or one that took longer than
   the time limit, fails just that request.
3. Each step, `step_bitmask` fills the allowed-token bitmask of the constrained rows that
   sample (one batched call into one [B, ceil(V/32)] int32 array) and the runner applies it
   to those rows' logits before the sampler (engine/worker/logits_processors.py).
4. After the step, `accept_tokens` advances each matcher with its sampled token; a matcher
   that terminated (the grammar is complete and EOS was taken) finishes its request with
   "stop" (engine/core/scheduler.py checks `request.structured.is_terminated`).
The matcher lives with the request, so preemption (recompute) keeps its state.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.engine.errors import EngineOverloadedError
from kvserve.engine.structured_output.compile_threads import CompileJob, CompilePool

if TYPE_CHECKING:
    from kvserve.engine.config import StructuredOutputsConfig
    from kvserve.engine.core.request import Request
    from kvserve.engine.core.scheduler import StepPlan
    from kvserve.engine.core.step_record import GrammarBitmask
    from kvserve.engine.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)


def _choice_grammar(choice: tuple[str, ...]) -> str:
    # EBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


class SequenceGrammar:
    """One sequence's matcher (each of a request's n samples has its own)."""

    __slots__ = ("matcher", "is_terminated", "json_whitespace")

    def __init__(self, matcher: Any, json_whitespace: bool | None = None) -> None:
        self.matcher = matcher
        self.is_terminated = False
        # JSON kinds: whether raw \t \n \r may appear (any_whitespace); None for other kinds
        self.json_whitespace = json_whitespace

    def valid_drafts(self, tokens: list[int]) -> int:
        """How many leading draft tokens the grammar allows without completing (state unchanged):
        a draft that would end the grammar is left for the step's own sampled token."""
        accepted = valid = 0
        for token_id in tokens:
            if not self.matcher.accept_token(token_id):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
            valid += 1
        if accepted:
            self.matcher.rollback(accepted)
        return valid

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            # cannot happen when the bitmask was applied; end the sequence rather than go on unconstrained
            logger.warning(
                "structured output: token %d rejected by the grammar; finishing the sequence",
                token_id,
            )
            self.is_terminated = True
        elif self.matcher.is_terminated():
            self.is_terminated = True


@dataclass(slots=True)
class _Pending:
    job: CompileJob
    children: list[Request]
    deadline: float  # time.monotonic() after which the request fails (grammar_compile_timeout_s)


class StructuredOutputManager:
    """Compiles grammars off the step loop and keeps the constrained requests until theirs is ready.

    A request waits at most `config.grammar_compile_timeout_s` for its grammar (queue and compile
    together); then it fails like a compile error, and the compile is dropped or abandoned when nobody
    else waits for it (engine/structured_output/compile_threads.py). At most `config.max_grammar_queue`
    distinct grammars (None: no bound) are queued or compiling at once, abandoned ones included: `add`
    raises `EngineOverloadedError` beyond that.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        config: StructuredOutputsConfig,
        max_workers: int = 2,
        cache_size: int = 128,
        fill_threads: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = (
            vocab_size  # the model's (may exceed the tokenizer's: the extra ids are never allowed)
        )
        self.eos_token_ids = list(eos_token_ids)
        self.max_workers = max_workers  # compile threads
        self.fill_threads = fill_threads  # threads of the per-step bitmask fill (fill_threads_for)
        self.cache_size = cache_size
        self.compile_timeout_s = config.grammar_compile_timeout_s
        self.max_queue = config.max_grammar_queue
        self._cache: OrderedDict[str, Any] = OrderedDict()  # spec key -> compiled grammar (LRU)
        self._jobs: dict[str, CompileJob] = {}  # spec key -> its compile, until it is done
        self._pending: dict[str, _Pending] = {}  # parent request id -> its children, waiting
        self._pool = CompilePool(
            lambda spec: self._compile(spec), max_workers
        )  # looked up per call: tests swap it
        self._compiler: Any = None  # xgrammar's, made on first use
        self._tokenizer_info: Any = None
        self._compiler_lock = threading.Lock()
        self._batch_matcher: Any = None
        self._no_control_masks: dict[bool, np.ndarray] = {}  # json_whitespace -> [ceil(V/32)] int32
        self.num_requests = 0  # constrained requests added
        self.num_compiles = 0
        self.compile_time_s = 0.0  # total, for metrics

    # ---- compiling ---------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_pending(self) -> int:
        """Requests waiting for their grammar (queued or compiling)."""
        return len(self._pending)

    @property
    def num_jobs(self) -> int:
        """Distinct grammars queued or compiling, abandoned ones included."""
        return sum(not job.future.done() for job in self._jobs.values())

    def lora_ids_pending(self) -> set[int]:
        """The LoRA adapters of the requests waiting here (0: none)."""
        return {child.lora_id for p in self._pending.values() for child in p.children}

    def add(self, request_id: str, children: list[Request], spec: StructuredOutputs) -> None:
        """Hold `children` until `spec` is compiled (at once when it is cached). Raises
        `EngineOverloadedError` when a new compile would exceed `max_queue`."""
        try:
            key = spec.key
        except RecursionError:  # a spec that skipped check_limits
            raise ValueError(f"structured_outputs.{spec.kind} is nested too deeply") from None
        self._sweep()
        job = self._jobs.get(key)
        if job is None:
            job = CompileJob(key, spec)
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                job.future.set_result(compiled)
            else:
                if self.max_queue is not None and len(self._jobs) >= self.max_queue:
                    raise EngineOverloadedError(
                        f"{len(self._jobs)} grammars are compiling or queued "
                        f"(max_grammar_queue={self.max_queue}); retry later"
                    )
                self._jobs[key] = job
                self._pool.submit(job)
        job.num_waiters += 1
        self._pending[request_id] = _Pending(
            job, children, time.monotonic() + self.compile_timeout_s
        )
        self.num_requests += 1

    def abort(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._release(pending.job)

    def _release(self, job: CompileJob) -> None:
        """One request less waits for `job`; the last one leaving cancels or abandons it."""
        job.num_waiters -= 1
        if job.num_waiters == 0 and not job.future.done():
            self._pool.cancel(job)
            if job.future.cancelled():
                self._jobs.pop(job.key, None)

    def wait(self, timeout_s: float) -> None:
        """Block until a held request's compile finishes, its deadline passes, or `timeout_s`:
        for an otherwise idle loop."""
        if self._pending:
            next_deadline = min(p.deadline for p in self._pending.values())
            timeout_s = max(0.0, min(timeout_s, next_deadline - time.monotonic()))
            wait([p.job.future for p in self._pending.values()], timeout_s, FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[Request], list[tuple[str, str]]]:
        """The sequences now ready to schedule (matchers attached), and (request id, error) of
        failed or timed-out compiles."""
        self._sweep()
        ready, failed = [], []
        now = time.monotonic()
        for request_id, pending in list(self._pending.items()):
            future = pending.job.future
            if not future.done():
                if now > pending.deadline:
                    del self._pending[request_id]
                    self._release(pending.job)
                    failed.append((request_id, self._timeout_message(pending.job)))
                continue
            del self._pending[request_id]
            pending.job.num_waiters -= 1
            error = future.exception()
            if error is not None:
                failed.append((request_id, str(error)))
                continue
            compiled = future.result()
            spec = pending.children[0].params.structured_outputs
            assert spec is not None  # only constrained requests wait for a compile
            json_whitespace = spec.any_whitespace if spec.kind in ("json", "json_object") else None
            for child in pending.children:
                child.structured = SequenceGrammar(self._new_matcher(compiled), json_whitespace)
                ready.append(child)
        return ready, failed

    def _timeout_message(self, job: CompileJob) -> str:
        return (
            f"structured_outputs.{job.spec.kind} could not be compiled within {self.compile_timeout_s:g} s "
            f"(grammar_compile_timeout_s={self.compile_timeout_s:g}); make the constraint smaller"
        )

    def _sweep(self) -> None:
        """Move finished compiles (abandoned ones too) from `_jobs` into the cache, and count them."""
        for key, job in list(self._jobs.items()):
            if not job.future.done():
                continue
            del self._jobs[key]
            if job.future.cancelled():
                continue
            self.num_compiles += 1
            self.compile_time_s += job.elapsed_s
            if job.future.exception() is None:
                self._cache[key] = job.future.result()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)

    def _compile(self, spec: StructuredOutputs) -> Any:
        """Runs on a compile thread."""
        compiler = self._get_compiler()
        kind, ws = spec.kind, spec.any_whitespace
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(
                    json.dumps(spec.json), any_whitespace=ws, strict_mode=True
                )
            elif kind == "json_object":
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=ws, strict_mode=False
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(_choice_grammar(spec.choice or ()))
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - the library raises RuntimeError with the parser's message
            raise ValueError(
                f"structured_outputs.{kind} could not be compiled: {_library_message(e)}"
            ) from None
        return compiled

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                self._tokenizer_info = info
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self.max_workers, cache_enabled=False
                )
            return self._compiler

    @staticmethod
    def _new_matcher(compiled: Any) -> Any:
        return import_xgrammar().GrammarMatcher(compiled)

    # ---- per step ----------------------------------------------------------------
    def step_bitmask(self, plan: StepPlan) -> GrammarBitmask | None:
        """The allowed tokens of this step's constrained, sampling rows; None when there are none.
        In a speculative step the rows are logits rows (1 + its drafts per request, in order), and
        a speculating sequence's row m is filled after its first m drafts (then rolled back)."""
        from kvserve.engine.core.step_record import GrammarBitmask

        expanded = any(item.spec_token_ids for item in plan.scheduled)
        rows: list[int] = []
        matchers: list[Any] = []
        json_rows: dict[bool, list[int]] = {False: [], True: []}
        first = 0
        drafted: list[tuple[int, SequenceGrammar, tuple[int, ...]]] = []
        for item in plan.scheduled:
            grammar, num_rows = _grammar(item.request), 1 + len(item.spec_token_ids)
            if grammar is not None and item.is_sampled:
                if item.spec_token_ids:
                    drafted.append((first, grammar, item.spec_token_ids))
                else:
                    rows.append(first)
                    matchers.append(grammar.matcher)
                if grammar.json_whitespace is not None:
                    json_rows[grammar.json_whitespace].extend(range(first, first + num_rows))
            first += num_rows if expanded else 1
        if not rows and not drafted:
            return None
        bitmask = np.empty((first, -(-self.vocab_size // 32)), np.int32)  # [B or R, ceil(V/32)]
        if rows:
            if self._batch_matcher is None:
                self._batch_matcher = import_xgrammar().BatchGrammarMatcher(self.fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        for start, grammar, drafts in drafted:
            rows.extend(self._fill_draft_rows(grammar, drafts, bitmask, start))
        for whitespace, json_row_ids in json_rows.items():
            if json_row_ids:
                bitmask[json_row_ids] &= self._no_control_mask(whitespace)
        return GrammarBitmask(tuple(rows), bitmask, expanded)

    @staticmethod
    def _fill_draft_rows(
        grammar: SequenceGrammar, drafts: tuple[int, ...], bitmask: np.ndarray, start: int
    ) -> list[int]:
        """Rows start .. start + len(drafts): the allowed tokens after 0, 1, ... of the drafts (which
        `valid_drafts` checked when they were proposed)."""
        import torch

        view = torch.from_numpy(bitmask)
        for m, token_id in enumerate((*drafts, None)):
            grammar.matcher.fill_next_token_bitmask(view, start + m)
            if token_id is not None:
                grammar.matcher.accept_token(token_id)
        grammar.matcher.rollback(len(drafts))
        return list(range(start, start + len(drafts) + 1))

    def _no_control_mask(self, whitespace: bool) -> np.ndarray:
        """Clears the tokens holding raw control bytes (U+0000-U+001F; \t \n \r allowed when
        `whitespace`): JSON never has them outside escapes, but xgrammar 0.2.8 lets them into
        strings with minLength/maxLength."""
        mask = self._no_control_masks.get(whitespace)
        if mask is None:
            allowed_ws = b"\t\n\r" if whitespace else b""
            control = set(range(32)) - set(allowed_ws)
            self._get_compiler()
            vocab = self._tokenizer_info.decoded_vocab
            bits = np.ones(-(-self.vocab_size // 32) * 32, bool)
            for token_id, token in enumerate(vocab[: self.vocab_size]):
                if control.intersection(token):
                    bits[token_id] = False
            mask = self._no_control_masks[whitespace] = np.packbits(bits, bitorder="little").view(
                np.int32
            )
        return mask

    @staticmethod
    def accept_tokens(
        plan: StepPlan,
        sampled_token_ids: list[int | None],
        accepted: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        """Advance each constrained sequence's matcher with its accepted drafts (when it speculated)
        and the token it sampled this step."""
        for item, token_id in zip(plan.scheduled, sampled_token_ids):
            grammar = _grammar(item.request)
            if grammar is None or token_id is None:
                continue
            for draft in (accepted or {}).get(item.request.request_id, ()):
                grammar.accept(draft)
            if not grammar.is_terminated:
                grammar.accept(token_id)


def fill_threads_for(device_type: str, torch_threads: int, host_cores: int) -> int:
    """Threads for the per-step bitmask fill. On the CPU the fill runs after the forward, on the
    cores the forward used (torch's threads). On a GPU it runs on the host while the device
    computes, and length-bounded strings make xgrammar's fill slow enough to show next to a GPU step
    (docs/performance.md, GPU): take half the host's cores, at most 8."""
    if device_type == "cpu":
        return max(1, torch_threads)
    return max(2, min(8, host_cores // 2))


def _library_message(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured outputs need xgrammar: pip install 'kvserve[structured]'"
        ) from None
    return xgrammar


def _grammar(request: Request) -> SequenceGrammar | None:
    """The request's grammar as this module made it (the core sees it as a `RequestGrammar`)."""
    grammar = request.structured
    assert grammar is None or isinstance(grammar, SequenceGrammar)
    return grammar

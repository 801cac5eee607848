"""Run validated requests on the engine and shape the results as OpenAI responses.

Each prompt of a request is one engine request (`{request_id}-{prompt_idx}`); the engine
fans out `n`. `Serving.outputs` yields `(prompt_idx, RequestOutput)` from all of them,
interleaved, and aborts every unfinished engine request when it is closed or cancelled
(client gone, error), which is what returns their KV blocks to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, Literal

from kvserve.engine.beam_search import BeamSearch
from kvserve.engine.errors import EngineDeadError, EngineOverloadedError, EngineShutDownError
from kvserve.engine.generation_config import beam_step_constraints
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.chat_output import ChoiceStreamer, read_choice
from kvserve.server.engine_protocol import ServingEngine
from kvserve.server.errors import APIError, bad_request, internal_error, shutting_down
from kvserve.server.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs
from kvserve.server.metrics import RequestTracker, ServerMetrics
from kvserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    FunctionCallOut,
    PromptTokensDetails,
    ToolCallOut,
    UsageInfo,
)
from kvserve.server.streaming import DONE_EVENT, sse_event
from kvserve.server.tool_parsers import new_call_id
from kvserve.server.validation import ValidatedRequest, param_for_message

logger = logging.getLogger("kvserve.server")
_END = object()


# `--max-queue auto` lets this many sequences wait per sequence that can run at once.
QUEUED_PER_RUNNING = 2


def resolve_max_queue(setting: int | str, max_num_seqs: int, num_kv_blocks: int) -> int | None:
    """The `--max-queue` bound in sequences (None: no bound). `auto` allows twice as many waiting
    sequences as can run at once: the smaller of `max_num_seqs` and the KV blocks, since every
    running sequence holds at least one block. The last one in line then starts after about two
    generations of the batch; past that, a 503 with Retry-After (a client's back-off, another
    replica) serves it better than a time to first token that grows without bound."""
    if setting == "off":
        return None
    if setting == "auto":
        return QUEUED_PER_RUNNING * max(min(max_num_seqs, num_kv_blocks), 1)
    return int(setting)


class Admission:
    """`--max-queue`: refuse a request (503) when more than `max_queue` sequences would be waiting.

    Counts the sequences (prompts x n) of HTTP requests in flight; those beyond `max_num_seqs`
    must queue. The engine's own `num_waiting` also counts (e.g. when KV blocks, not seats, run out).
    Once closed (the server is shutting down), every request is refused with 503.
    """

    def __init__(self, engine: ServingEngine, max_queue: int | None, max_num_seqs: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.max_num_seqs = max_num_seqs
        self.num_in_flight = 0
        self.is_closed = False

    def close(self) -> None:
        self.is_closed = True

    def reserve(self, vreq: ValidatedRequest) -> int:
        return self.reserve_seqs(len(vreq.prompts) * vreq.num_choices)

    def reserve_seqs(self, num_seqs: int) -> int:
        """Admit `num_seqs` sequences (503 if they would overfill the queue); -> what `release` takes."""
        if self.is_closed:
            raise shutting_down()
        if self.max_queue is not None:
            num_queued = max(self.num_in_flight + num_seqs - self.max_num_seqs, 0)
            num_waiting = self.engine.stats().num_waiting
            if num_waiting > 0:
                num_queued = max(num_queued, num_waiting + num_seqs)
            if num_queued > self.max_queue:
                raise APIError(
                    503,
                    f"the server is overloaded ({num_queued} requests would wait, "
                    f"--max-queue is {self.max_queue}); retry later",
                    code="server_overloaded",
                    headers={"Retry-After": "1"},
                )
        self.num_in_flight += num_seqs
        return num_seqs

    def release(self, num_seqs: int) -> None:
        self.num_in_flight -= num_seqs


async def prepend(first: Any, rest: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


def _finish_reason(choice: Any) -> Literal["stop", "length"] | None:
    reason = choice.finish_reason
    if reason == "abort":
        raise APIError(500, "the engine aborted this request", code="aborted")
    return reason


class Serving:
    """Turns `ValidatedRequest`s into engine requests and OpenAI-shaped results."""

    def __init__(
        self, engine: ServingEngine, metrics: ServerMetrics, token_text: TokenText
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.token_text = token_text

    # ------------------------------------------------------------------ engine side

    async def outputs(self, vreq: ValidatedRequest) -> AsyncGenerator[tuple[int, Any], None]:
        """`(prompt_idx, RequestOutput)` from every prompt's engine request, as they come."""
        if vreq.beam is not None:
            async with aclosing(self._beam_outputs(vreq)) as beams:
                async for item in beams:
                    yield item
            return
        streams = [self._generate(vreq, i) for i in range(len(vreq.prompts))]
        if len(streams) == 1:
            async with aclosing(streams[0]) as stream:
                async for out in stream:
                    yield 0, out
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(i: int, stream: AsyncGenerator[Any, None]) -> None:
            try:
                async with aclosing(stream):
                    async for out in stream:
                        queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, _END))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            num_open = len(tasks)
            while num_open:
                i, item = await queue.get()
                if item is _END:
                    num_open -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, vreq: ValidatedRequest, prompt_idx: int) -> AsyncGenerator[Any, None]:
        stream = self._engine_stream(
            vreq,
            f"{vreq.request_id}-{prompt_idx}",
            vreq.prompts[prompt_idx].token_ids,
            vreq.params,
            self.metrics.tracker(),
            vreq.decoder_prompt_token_ids,
        )
        async with aclosing(stream):
            async for out in stream:
                yield out

    async def _engine_stream(
        self,
        vreq: ValidatedRequest,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        tracker: RequestTracker | None,
        decoder_prompt: list[int] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """One engine request's outputs, its errors turned into API errors; aborted if left early.
        `decoder_prompt`: an encoder-decoder's decoder tokens so far (the request's decoder prefix, or
        a beam's tokens), `token_ids` its source."""
        is_finished = False
        prompt: Any = token_ids
        if vreq.cache_salt is not None or decoder_prompt is not None or vreq.priority:
            prompt = {"prompt_token_ids": token_ids}
            if vreq.cache_salt is not None:
                prompt["cache_salt"] = vreq.cache_salt
            if vreq.priority:
                prompt["priority"] = vreq.priority
            if decoder_prompt is not None:
                prompt["decoder_prompt_token_ids"] = decoder_prompt
        lora = {"lora_request": vreq.lora_request} if vreq.lora_request is not None else {}
        stream = self.engine.generate(prompt, params, request_id, **lora)
        try:
            async for out in stream:
                if tracker is not None:
                    tracker.observe(out)
                is_finished = out.finished
                yield out
        except ValueError as exc:  # the engine refused the request (or its grammar did not compile)
            message, param = str(exc), param_for_message(str(exc))
            if vreq.structured_outputs_param is not None and message.startswith(
                "structured_outputs"
            ):
                message, param = (
                    f"{vreq.structured_outputs_param}: {message}",
                    vreq.structured_outputs_param,
                )
            raise bad_request(message, param=param) from None
        except (
            EngineOverloadedError
        ) as exc:  # the grammar compile queue is full (--max-grammar-queue)
            raise APIError(
                503,
                f"the server is overloaded: {exc}",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            ) from None
        except EngineShutDownError:
            raise shutting_down() from None
        except EngineDeadError as exc:  # its cause goes to the log, not to the client
            logger.warning(
                "request %s failed: the engine is dead (%s)", vreq.request_id, exc.__cause__ or exc
            )
            raise APIError(
                503,
                f"the engine is not running (request id {vreq.request_id})",
                code="engine_dead",
                headers={"X-Request-Id": vreq.request_id},
            ) from None
        finally:
            await stream.aclose()
            if not is_finished:
                await self._abort(request_id)

    async def _beam_outputs(self, vreq: ValidatedRequest) -> AsyncGenerator[tuple[int, Any], None]:
        """Beam search (engine/beam_search.py): each step runs one single-token engine request per
        live beam of every prompt, all at once; at the end, one finished output per prompt whose
        choices are its n best hypotheses. Step requests are not in the per-request metrics; the
        search is, once, when it ends."""
        started = time.monotonic()
        start_id = (
            self.engine.model_config.decoder_start_token_id
        )  # an encoder-decoder: beams are decoder tokens
        decoder_start = vreq.decoder_prompt_token_ids or (
            [start_id] if start_id is not None else []
        )
        beam_starts = [decoder_start if start_id is not None else p.token_ids for p in vreq.prompts]
        beam = vreq.beam
        assert beam is not None  # only beam search requests come here
        search = BeamSearch(beam_starts, beam, self.engine.model_config.eos_token_ids)
        constraints = self.engine.model_config.generation_config.constraints

        def step_params(step: int) -> SamplingParams:  # the checkpoint's processors as of this step
            return SamplingParams(
                max_tokens=1,
                temperature=0.0,
                logprobs=search.num_logprobs,
                ignore_eos=True,
                generation_constraints=beam_step_constraints(constraints, step, beam.max_tokens),
            )

        async def next_token_logprobs(
            request_id: str, prompt_idx: int, token_ids: list[int], params: SamplingParams
        ) -> dict[int, float]:
            final = None
            source, decoder = (
                (vreq.prompts[prompt_idx].token_ids, token_ids)
                if start_id is not None
                else (token_ids, None)
            )
            async with aclosing(
                self._engine_stream(vreq, request_id, source, params, None, decoder)
            ) as stream:
                async for final in stream:
                    pass
            assert final is not None  # a finished request has a last output
            return {token: lp.logprob for token, lp in final.outputs[0].logprobs[0].items()}

        while beams := search.live_beams():
            params = step_params(search.step)
            tasks = [
                asyncio.ensure_future(
                    next_token_logprobs(
                        f"{vreq.request_id}-beam{search.step}-{j}", i, tokens, params
                    )
                )
                for j, (i, tokens) in enumerate(beams)
            ]
            try:
                search.advance(await asyncio.gather(*tasks))
            finally:  # one failed or the client left: the others stop too (and abort their requests)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        timings = RequestMetrics(arrival_time=started, finished_time=time.monotonic())
        for i, result in enumerate(search.outputs()):
            choices = []
            for k, seq in enumerate(result.sequences):
                text = self.engine.tokenizer.decode(
                    seq.generated_tokens, skip_special_tokens=vreq.params.skip_special_tokens
                )
                choices.append(
                    CompletionOutput(
                        index=k,
                        text=text,
                        token_ids=seq.generated_tokens,
                        cumulative_logprob=seq.cum_logprob,
                        finish_reason=seq.finish_reason,
                        delta_text=text,
                        delta_token_ids=seq.generated_tokens,
                    )
                )
            out = RequestOutput(
                f"{vreq.request_id}-{i}",
                vreq.prompts[i].text,
                vreq.prompts[i].token_ids,
                choices,
                finished=True,
                metrics=timings,
            )
            self.metrics.tracker().observe(out)
            yield i, out

    async def _abort(self, request_id: str) -> None:
        try:
            await asyncio.shield(
                self.engine.abort(request_id)
            )  # runs to the end even if we are cancelled
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.warning("abort(%s) failed", request_id, exc_info=True)

    # ------------------------------------------------------------------ non-streaming

    async def complete(
        self, vreq: ValidatedRequest, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> dict[str, Any]:
        """Run to the end and build the whole response body."""
        if vreq.kind == "chat":
            return (await self.chat_response(vreq, outputs)).model_dump(mode="json")
        choices: dict[tuple[int, int], Any] = {}
        prompt_logprobs: dict[int, Any] = {}
        num_cached: dict[int, int] = {}
        async for i, out in outputs:
            for choice in out.outputs:
                choices[(i, choice.index)] = choice
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            num_cached[i] = out.num_cached_tokens
        usage = self._usage(vreq, choices.values(), sum(num_cached.values()))
        created = int(time.time())
        return CompletionResponse(
            id=vreq.request_id,
            created=created,
            model=vreq.model_name,
            usage=usage,
            choices=[
                self._completion_choice(
                    vreq,
                    i,
                    c,
                    prompt_logprobs.get(i),
                    first=True,
                    whole=True,
                    offsets=self._text_offsets(vreq, i),
                )
                for (i, _), c in sorted(choices.items())
            ],
        ).model_dump(mode="json")

    async def chat_response(
        self, vreq: ValidatedRequest, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> ChatCompletionResponse:
        """A chat request run to the end (also the base of /v1/responses and /v1/messages)."""
        choices: dict[int, Any] = {}
        num_cached = 0
        async for _, out in outputs:
            for choice in out.outputs:
                choices[choice.index] = choice
            num_cached = out.num_cached_tokens
        results = [self._chat_choice(vreq, choices[key]) for key in sorted(choices)]
        usage = self._usage(vreq, choices.values(), num_cached, sum(n for _, n in results))
        return ChatCompletionResponse(
            id=vreq.request_id,
            created=int(time.time()),
            model=vreq.model_name,
            usage=usage,
            choices=[c for c, _ in results],
        )

    def _usage(
        self,
        vreq: ValidatedRequest,
        choices: Any,
        num_cached: int = 0,
        num_reasoning: int | None = None,
    ) -> UsageInfo:
        """`num_cached`: prompt tokens found in the prefix cache (each prompt once, as prompt_tokens counts them)."""
        num_prompt = sum(len(p.token_ids) for p in vreq.prompts)
        num_completion = 0 if vreq.is_scoring_only else sum(len(c.token_ids) for c in choices)
        details = None
        if vreq.reasoning is not None and num_reasoning is not None:
            details = CompletionTokensDetails(reasoning_tokens=num_reasoning)
        return UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
            completion_tokens_details=details,
        )

    def _decode(self, vreq: ValidatedRequest) -> Callable[[list[int]], str]:
        skip = vreq.params.skip_special_tokens
        return lambda token_ids: self.engine.tokenizer.decode(token_ids, skip_special_tokens=skip)

    def _chat_choice(self, vreq: ValidatedRequest, choice: Any) -> tuple[ChatChoice, int]:
        """The choice and its number of reasoning tokens."""
        logprobs = None
        if vreq.num_logprobs is not None:
            logprobs = ChatLogprobs(
                content=chat_logprobs(
                    choice.token_ids, choice.logprobs or [], vreq.num_logprobs, self.token_text
                )
            )
        finish_reason = _finish_reason(choice)
        parts = read_choice(vreq, choice.text, choice.token_ids, self._decode(vreq))
        tool_calls = [
            ToolCallOut(
                id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments)
            )
            for c in parts.calls
        ]
        message = ChatMessageOut(
            content=parts.content, reasoning_content=parts.reasoning, tool_calls=tool_calls or None
        )
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=logprobs,
            stop_reason=choice.stop_reason,
            finish_reason="tool_calls" if parts.calls else finish_reason,
        ), parts.num_reasoning_tokens

    def _completion_choice(
        self,
        vreq: ValidatedRequest,
        prompt_idx: int,
        choice: Any,
        prompt_logprobs: Any,
        first: bool,
        whole: bool,
        offsets: TextOffsets,
    ) -> CompletionChoice:
        """A choice from the whole output (`whole`) or from its delta; `first` adds the echoed prompt.
        `offsets` (one per choice, kept across a stream's chunks) places the generated tokens."""
        prompt = vreq.prompts[prompt_idx]
        text = ""
        token_ids: list[int] = []
        logprobs: list[Any] = []
        if not vreq.is_scoring_only:
            text = choice.text if whole else choice.delta_text
            token_ids = choice.token_ids if whole else choice.delta_token_ids
            logprobs = (choice.logprobs if whole else choice.delta_logprobs) or []
        echo = vreq.is_echo and first
        result = None
        if vreq.num_logprobs is not None:
            result = CompletionLogprobs()
            if echo:
                result = completion_logprobs(
                    prompt.token_ids,
                    prompt_logprobs or [None] * len(prompt.token_ids),
                    vreq.num_logprobs,
                    self.token_text,
                    TextOffsets(self.token_text, False, text=prompt.text),
                )
            generated = completion_logprobs(
                token_ids, logprobs, vreq.num_logprobs, self.token_text, offsets
            )
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(result, field).extend(getattr(generated, field))
        return CompletionChoice(
            index=prompt_idx * vreq.num_choices + choice.index,
            text=(prompt.text if echo else "") + text,
            logprobs=result,
            finish_reason=_finish_reason(choice),
        )

    def _text_offsets(self, vreq: ValidatedRequest, prompt_idx: int) -> TextOffsets:
        """Offsets of a choice's generated tokens: they follow the echoed prompt, if any."""
        start = len(vreq.prompts[prompt_idx].text) if vreq.is_echo else 0
        return TextOffsets(self.token_text, vreq.params.skip_special_tokens, start=start)

    # ------------------------------------------------------------------ streaming

    async def events(
        self, vreq: ValidatedRequest, first: Any, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> AsyncGenerator[str, None]:
        """SSE events for a streaming request; errors after the start become an error event."""
        chunks = self.chat_chunks if vreq.kind == "chat" else self._completion_chunks
        exclude = None if vreq.include_usage else {"usage"}
        try:
            async with aclosing(outputs):
                async for chunk in chunks(vreq, prepend(first, outputs)):
                    yield sse_event(chunk.model_dump_json(exclude=exclude))
        except APIError as exc:
            yield sse_event(exc.body())
        except Exception:
            logger.exception("request %s failed mid-stream", vreq.request_id)
            yield sse_event(internal_error(vreq.request_id).body())
        yield DONE_EVENT

    async def _completion_chunks(
        self, vreq: ValidatedRequest, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> AsyncGenerator[Any, None]:
        created = int(time.time())
        started: set[tuple[int, int]] = set()
        finals: dict[tuple[int, int], Any] = {}
        text_offsets: dict[tuple[int, int], TextOffsets] = {}
        prompt_logprobs: dict[int, Any] = {}
        num_cached: dict[int, int] = {}
        async for i, out in outputs:
            num_cached[i] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_logprobs.setdefault(i, out.prompt_logprobs)
            for choice in out.outputs:
                key = (i, choice.index)
                if key in finals:
                    continue
                is_first = key not in started
                started.add(key)
                if is_first:
                    text_offsets[key] = self._text_offsets(vreq, i)
                c = self._completion_choice(
                    vreq,
                    i,
                    choice,
                    prompt_logprobs.get(i),
                    first=is_first,
                    whole=False,
                    offsets=text_offsets[key],
                )
                if choice.finish_reason is not None:
                    finals[key] = choice
                if c.text or c.finish_reason or (c.logprobs and c.logprobs.tokens):
                    yield CompletionResponse(
                        id=vreq.request_id, created=created, model=vreq.model_name, choices=[c]
                    )
        if vreq.include_usage:
            yield CompletionResponse(
                id=vreq.request_id,
                created=created,
                model=vreq.model_name,
                choices=[],
                usage=self._usage(vreq, finals.values(), sum(num_cached.values())),
            )

    async def chat_chunks(
        self, vreq: ValidatedRequest, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        """A chat stream's chunks (also the base of /v1/responses' and /v1/messages' events)."""
        created = int(time.time())

        def chunk(
            choices: list[ChatStreamChoice], usage: UsageInfo | None = None
        ) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=vreq.request_id,
                created=created,
                model=vreq.model_name,
                choices=choices,
                usage=usage,
            )

        for index in range(vreq.num_choices):
            yield chunk([ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""})])
        finals: dict[int, Any] = {}
        streamers: dict[
            int, ChoiceStreamer
        ] = {}  # reasoning and tool calls: text that may start one is held back
        num_cached = 0
        async for _, out in outputs:
            num_cached = out.num_cached_tokens
            for choice in out.outputs:
                if choice.index in finals:
                    continue
                logprobs = None
                if vreq.num_logprobs is not None and choice.delta_token_ids:
                    logprobs = ChatLogprobs(
                        content=chat_logprobs(
                            choice.delta_token_ids,
                            choice.delta_logprobs or [],
                            vreq.num_logprobs,
                            self.token_text,
                        )
                    )
                streamer = streamers.setdefault(choice.index, ChoiceStreamer(vreq))
                deltas = streamer.feed(choice.delta_text)
                if (
                    logprobs is not None
                ):  # logprobs ride on the first delta (an empty content one if none)
                    first = (
                        deltas[0] if deltas and "tool_calls" not in deltas[0] else {"content": ""}
                    )
                    yield chunk(
                        [ChatStreamChoice(index=choice.index, delta=first, logprobs=logprobs)]
                    )
                    deltas = deltas[1:] if deltas and deltas[0] is first else deltas
                for delta in deltas:
                    yield chunk([ChatStreamChoice(index=choice.index, delta=delta)])
                if choice.finish_reason is not None:
                    finals[choice.index] = choice
                    finish_reason: Literal["stop", "length", "tool_calls"] | None = _finish_reason(
                        choice
                    )
                    deltas, made_calls = streamer.finish(choice.token_ids, self._decode(vreq))
                    for delta in deltas:
                        yield chunk([ChatStreamChoice(index=choice.index, delta=delta)])
                    finish_reason = "tool_calls" if made_calls else finish_reason
                    yield chunk(
                        [
                            ChatStreamChoice(
                                index=choice.index,
                                delta={},
                                finish_reason=finish_reason,
                                stop_reason=choice.stop_reason,
                            )
                        ]
                    )
        if vreq.include_usage:
            num_reasoning = sum(s.num_reasoning_tokens for s in streamers.values())
            yield chunk([], usage=self._usage(vreq, finals.values(), num_cached, num_reasoning))

"""A minimal OpenAI-compatible server that runs ONE request at a time.

`python -m benchmarks.baseline_server --model DIR --port P`

It is the "no continuous batching" reference for benchmarks: a single worker
thread (the lock) pulls requests from a FIFO queue and decodes them token by
token with `transformers` and its KV cache (what `generate` does inside), so
requests queue behind each other exactly as they would behind a lock around
`generate`. It honours max_tokens, min_tokens, ignore_eos, temperature, top_p
and seed, streams SSE, reports usage, and stops decoding when a client hangs up.
Not supported: n > 1, stop strings, logprobs, batched prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BadRequest(ValueError):
    """Becomes an OpenAI-style HTTP 400."""


@dataclass(slots=True)
class Job:
    """One request's work item; the worker thread posts events to `events`."""

    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    seed: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # int ids, then ("done", reason)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class BaselineEngine:
    """Owns the model and the single worker thread that serializes requests."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        config = self.model.config
        self.max_model_len: int = (
            getattr(config, "max_position_embeddings", None) or config.n_positions
        )
        self.vocab_size: int = config.vocab_size
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(set(eos))
        self.jobs: queue.Queue[Job] = queue.Queue()
        threading.Thread(target=self._worker, daemon=True, name="baseline-worker").start()

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def _worker(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job.post(("done", self._decode(job)))
            except Exception as exc:  # report to the waiting handler, keep serving
                job.post(exc)

    @torch.inference_mode()
    def _decode(self, job: Job) -> str:
        """Greedy or sampled decoding with the HF KV cache; returns the finish reason."""
        gen = torch.Generator().manual_seed(job.seed) if job.seed is not None else None
        out = self.model(input_ids=torch.tensor([job.prompt_ids]), use_cache=True)
        for step in range(job.max_tokens):
            if job.cancelled.is_set():
                return "abort"
            logits = out.logits[0, -1].float()  # [vocab]
            if step < job.min_tokens and self.eos_ids:
                logits[self.eos_ids] = float("-inf")
            token = self._sample(logits, job.temperature, job.top_p, gen)
            job.post(token)
            if token in self.eos_ids and not job.ignore_eos:
                return "stop"
            if step + 1 < job.max_tokens:
                out = self.model(
                    input_ids=torch.tensor([[token]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        return "length"

    @staticmethod
    def _sample(
        logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None
    ) -> int:
        if temperature < 1e-5:
            return int(logits.argmax())
        probs = (logits / temperature).softmax(-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=gen))


def _job_from_body(engine: BaselineEngine, body: dict, prompt_ids: list[int]) -> Job:
    if not prompt_ids:
        raise BadRequest("the prompt is empty")
    if any(not isinstance(t, int) or not 0 <= t < engine.vocab_size for t in prompt_ids):
        raise BadRequest(f"prompt token ids must be ints in [0, {engine.vocab_size})")
    room = engine.max_model_len - len(prompt_ids)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or room
    if max_tokens > room:
        raise BadRequest(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
            f"the model's {engine.max_model_len}"
        )
    temperature = body.get("temperature")
    return Job(
        prompt_ids=prompt_ids,
        max_tokens=int(max_tokens),
        min_tokens=int(body.get("min_tokens") or 0),
        ignore_eos=bool(body.get("ignore_eos")),
        temperature=1.0 if temperature is None else float(temperature),
        top_p=float(body.get("top_p") or 1.0),
        seed=body.get("seed"),
        loop=asyncio.get_running_loop(),
    )


def _completion_prompt_ids(engine: BaselineEngine, prompt: object) -> list[int]:
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise BadRequest("prompt must be a string or a list of token ids (no batches)")


def _chat_prompt_ids(engine: BaselineEngine, messages: object) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    if engine.tokenizer.chat_template:
        text = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    else:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
    return engine.tokenizer.encode(text, add_special_tokens=False)


class _TextStream:
    """Incremental detokenization that holds back incomplete UTF-8 characters."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.token_ids, self.num_sent_chars = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.token_ids.append(token)
        return self._delta(final=False)

    def _delta(self, final: bool) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""  # a multi-byte character is split across tokens; wait for the rest
        delta, self.num_sent_chars = text[self.num_sent_chars :], len(text)
        return delta

    def flush(self) -> str:
        return self._delta(final=True)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError", "code": status}}, status
    )


def _usage(job: Job, num_output_tokens: int) -> dict:
    n = len(job.prompt_ids)
    return {
        "prompt_tokens": n,
        "completion_tokens": num_output_tokens,
        "total_tokens": n + num_output_tokens,
    }


class _Response:
    """Builds OpenAI-shaped completion or chat payloads for one request."""

    def __init__(self, is_chat: bool, model: str) -> None:
        self.is_chat, self.model = is_chat, model
        self.id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.is_chat:
            delta = ({"role": "assistant"} if role else {}) | (
                {"content": text} if text is not None else {}
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.is_chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion" if self.is_chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }


async def _generate(engine: BaselineEngine, job: Job) -> AsyncIterator[int | str]:
    """Queue the job; yield token ids, then the finish reason (str). Cancels on exit."""
    engine.submit(job)
    try:
        while True:
            item = await job.events.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):
                yield item[1]
                return
            yield item
    finally:
        job.cancelled.set()  # a no-op when finished; stops decoding when the client left


def _stream(
    engine: BaselineEngine, job: Job, resp: _Response, include_usage: bool
) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        text, num_tokens = _TextStream(engine.tokenizer), 0
        if resp.is_chat:
            yield _sse(resp.chunk("", role=True))
        try:
            async for item in _generate(engine, job):
                if isinstance(item, str):
                    yield _sse(resp.chunk(text.flush(), finish_reason=item))
                    break
                num_tokens += 1
                delta = text.push(item)
                if delta:
                    yield _sse(resp.chunk(delta))
        except Exception as exc:  # mid-stream failure: tell the client in-band
            yield _sse({"error": {"message": f"{type(exc).__name__}: {exc}", "code": 500}})
            return
        finally:
            # Also reached when the client hangs up (the generator is closed at a
            # yield): stop decoding now rather than when _generate is collected.
            job.cancelled.set()
        if include_usage:
            yield _sse({**resp.chunk(None), "choices": [], "usage": _usage(job, num_tokens)})
        yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")


async def _complete(engine: BaselineEngine, job: Job, resp: _Response) -> JSONResponse:
    token_ids, reason = [], "length"
    async for item in _generate(engine, job):
        if isinstance(item, str):
            reason = item
        else:
            token_ids.append(item)
    text = engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    return JSONResponse(resp.full(text, reason, _usage(job, len(token_ids))))


def build_app(engine: BaselineEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="loadtest baseline server (one request at a time)")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "baseline",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def handle(request: Request, is_chat: bool):
        try:
            body = await request.json()
            if is_chat:
                prompt_ids = _chat_prompt_ids(engine, body.get("messages"))
            else:
                prompt_ids = _completion_prompt_ids(engine, body.get("prompt"))
            job = _job_from_body(engine, body, prompt_ids)
        except (BadRequest, ValueError, TypeError, KeyError) as exc:
            return _error(400, str(exc))
        resp = _Response(is_chat, model_name)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return _stream(engine, job, resp, include_usage)
        return await _complete(engine, job, resp)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, is_chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        add_special = body.get("add_special_tokens")
        ids = engine.tokenizer.encode(
            body.get("prompt", ""), add_special_tokens=add_special is not False
        )
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return {"prompt": engine.tokenizer.decode((await request.json()).get("tokens", []))}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--served-model-name", help="default: the model folder's name")
    args = parser.parse_args(argv)
    engine = BaselineEngine(args.model, DTYPES[args.dtype])
    app = build_app(engine, args.served_model_name or Path(args.model).resolve().name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

"""One streamed request: send it, time every SSE chunk, and record the outcome.

Timing rules (all `time.perf_counter()` seconds):
- TTFT: send -> first chunk that carries output text (role-only chat chunks don't count).
- ITL: gap between consecutive content chunks; a chunk holding k tokens
  contributes k entries of gap / k ("spread"), so the list is per token.
- E2E: send -> end of stream. TPOT = (E2E - TTFT) / (output_tokens - 1).
Output tokens come from the server's final `usage` chunk (we ask for it with
`stream_options.include_usage`); chunk counting is only the fallback.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from kvserve.loadtest.datasets import BenchRequest

OK, FAILED, DISCONNECTED = "ok", "failed", "disconnected"


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; serialized as-is into result.json."""

    index: int
    prompt_len: int  # from the dataset
    max_tokens: int
    scheduled_s: float  # due time, from the run start
    sent_s: float = 0.0  # actual send time (later when the concurrency cap held it back)
    status: str = FAILED  # OK | FAILED | DISCONNECTED
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # per token after the first chunk
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    num_chunks: int = 0  # content chunks received
    has_usage: bool = False
    disconnect_after_chunks: int | None = None  # planned early close (None = read to the end)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot_s": self.tpot_s}


def distribute_tokens(num_tokens: int, text_lens: list[int]) -> list[int]:
    """Split `num_tokens` over chunks: one each, the rest in proportion to text length.

    Used when the server reports more tokens in `usage` than it sent chunks
    (a detokenizer that held back partial characters, or several tokens per step).
    """
    counts = [1] * len(text_lens)
    extra = num_tokens - len(text_lens)
    if extra <= 0 or not text_lens:
        return counts
    weights = [max(n, 1) for n in text_lens]
    total = sum(weights)
    shares = [extra * w / total for w in weights]
    floors = [int(s) for s in shares]
    # Largest remainder keeps the sum exact.
    order = sorted(range(len(shares)), key=lambda i: floors[i] - shares[i])
    for i in order[: extra - sum(floors)]:
        floors[i] += 1
    return [c + f for c, f in zip(counts, floors)]


def spread_itl(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """Per-token inter-token latencies; the first chunk's tokens get none."""
    itl: list[float] = []
    for prev, now, k in zip(chunk_times, chunk_times[1:], chunk_tokens[1:]):
        itl.extend([(now - prev) / k] * k)
    return itl


def build_payload(
    endpoint: str, model: str, req: BenchRequest, ignore_eos: bool, temperature: float
) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # kvserve/vLLM extensions: force exactly output_len tokens
        payload.update(ignore_eos=True, min_tokens=req.output_len)
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    return payload


def error_reason(status: int, body: bytes) -> str:
    """`HTTP <status>: <message>` from an OpenAI-style or FastAPI error body."""
    message = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(message)
        err = obj.get("error", obj.get("detail", obj.get("message", message)))
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {message[:200]}"


def _chunk_content(obj: dict, endpoint: str) -> tuple[str, int | None]:
    """(text, explicit token count or None) of one stream chunk."""
    choices = obj.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
    token_ids = choice.get("token_ids")  # vLLM's return_token_ids; absent elsewhere
    return text or "", len(token_ids) if isinstance(token_ids, list) else None


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict,
    record: RequestRecord,
    endpoint: str,
    run_start: float,
) -> RequestRecord:
    """Stream one request into `record` (mutated and returned); never raises for I/O."""
    chunk_times: list[float] = []
    chunk_texts: list[int] = []
    chunk_counts: list[int | None] = []
    start = time.perf_counter()
    record.sent_s = start - run_start
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                record.error = error_reason(resp.status_code, await resp.aread())
                return record
            await _read_stream(resp, record, endpoint, chunk_times, chunk_texts, chunk_counts)
            if record.status == FAILED and record.error is None:
                record.error = "stream ended without [DONE]"
    except Exception as exc:  # any transport/protocol failure is a result, not a crash
        record.status, record.error = FAILED, f"{type(exc).__name__}: {str(exc)[:120]}"
    finally:
        record.e2e_s = time.perf_counter() - start
        _finish_timing(record, start, chunk_times, chunk_texts, chunk_counts)
    return record


async def _read_stream(
    resp: httpx.Response,
    record: RequestRecord,
    endpoint: str,
    chunk_times: list[float],
    chunk_texts: list[int],
    chunk_counts: list[int | None],
) -> None:
    """Consume SSE lines into the chunk lists; sets record.status (OK only on [DONE])."""
    if record.disconnect_after_chunks == 0:
        record.status = DISCONNECTED  # close right after the headers
        return
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            record.status = OK
            return
        obj = json.loads(data)
        if "error" in obj:
            err = obj["error"]
            record.error = "stream error: " + str(
                err.get("message", err) if isinstance(err, dict) else err
            )
            return
        if obj.get("usage"):
            record.prompt_tokens = obj["usage"].get("prompt_tokens")
            record.output_tokens = obj["usage"].get("completion_tokens", 0)
            record.has_usage = True
        text, count = _chunk_content(obj, endpoint)
        if text or count:
            chunk_times.append(time.perf_counter())
            chunk_texts.append(len(text))
            chunk_counts.append(count)
            if len(chunk_times) == record.disconnect_after_chunks:
                record.status = DISCONNECTED
                return


def _finish_timing(
    record: RequestRecord,
    start: float,
    chunk_times: list[float],
    chunk_texts: list[int],
    chunk_counts: list[int | None],
) -> None:
    record.num_chunks = len(chunk_times)
    if not chunk_times:
        return
    record.ttft_s = chunk_times[0] - start
    if all(c is not None for c in chunk_counts):
        tokens = [int(c) for c in chunk_counts if c is not None]  # the server told us exactly
    elif record.has_usage and record.status == OK:
        tokens = distribute_tokens(record.output_tokens, chunk_texts)
    else:
        tokens = [1] * len(chunk_times)
    if not record.has_usage or record.status != OK:
        record.output_tokens = sum(tokens)  # usage comes only at the end of a full stream
    record.itl_s = spread_itl(chunk_times, tokens)

"""POST /v1/embeddings (OpenAI's Embeddings API): schema, validation and the answer.

Each input becomes one engine request with `PoolingParams`: a prefill that samples nothing, whose
prompt's final hidden states are pooled (engine/pooling_params.py) and which frees its KV blocks in
the step that completes its prompt. The inputs of one call run together, batched by the engine.
The engine sends each vector as little-endian float32 bytes: `encoding_format: "base64"` returns
them as they are (base64, as OpenAI does), `"float"` as a JSON list.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import sys
import uuid
from array import array
from contextlib import aclosing
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictBool, StrictStr

from kvserve.engine.errors import EngineDeadError, EngineShutDownError
from kvserve.engine.pooling_params import PoolingParams
from kvserve.server.errors import APIError, bad_request, internal_error, shutting_down
from kvserve.server.protocol import TokenIds, _Request, json_int
from kvserve.server.streaming import ClientDisconnected, run_until_disconnect
from kvserve.server.validation import check_model

logger = logging.getLogger("kvserve.server")
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request

EmbeddingInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class EmbeddingRequest(_Request):
    input: EmbeddingInput = Field(
        description="Text, a list of texts, token ids, or a list of token-id lists."
    )
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: json_int(ge=1) | None = Field(
        None,
        description="Keep the first N dimensions: only for checkpoints that declare Matryoshka embeddings.",
    )
    user: StrictStr | None = None
    normalize: StrictBool | None = Field(
        None, description="L2-normalize the vectors (default: the model's, true)."
    )


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _inputs(value: Any) -> list[str | list[int]]:
    """The request's inputs as a list; 400 for an empty one."""
    items = (
        [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    )
    if not items:
        raise bad_request("input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise bad_request(
            f"{len(items)} inputs is more than {MAX_INPUTS} in one request", param="input"
        )
    for i, item in enumerate(items):
        if len(item) == 0:
            raise bad_request(f"input[{i}] is empty", param="input")
    return items


def pooling_params(body: EmbeddingRequest, model_config: Any) -> PoolingParams:
    """The request's pooling, checked against what the model can do (400 naming the field)."""
    pooler = getattr(model_config, "pooler", None)
    if pooler is None:
        raise bad_request(
            "this model cannot compute embeddings (an encoder-decoder model)", param="model"
        )
    params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
    try:
        return pooler.resolve(params)
    except ValueError as exc:
        raise bad_request(str(exc), param="dimensions") from None


def _vector(data: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(data).decode("ascii")
    values = array("f")
    values.frombytes(data)
    if sys.byteorder == "big":  # the engine sends little-endian
        values.byteswap()
    return values.tolist()


async def _embed_one(
    engine: Any, prompt: str | list[int], params: PoolingParams, request_id: str
) -> Any:
    """One input's finished engine output; the engine's refusals as API errors."""
    final = None
    engine_prompt = (
        {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
    )
    try:
        async with aclosing(engine.generate(engine_prompt, params, request_id)) as stream:
            async for final in stream:
                pass
    except ValueError as exc:  # too long, bad token ids...
        code = "context_length_exceeded" if "context length" in str(exc) else None
        raise bad_request(str(exc), param="input", code=code) from None
    except EngineShutDownError:
        raise shutting_down() from None
    except EngineDeadError:
        raise APIError(
            503, f"the engine is not running (request id {request_id})", code="engine_dead"
        ) from None
    if final is None or final.embedding is None:
        raise APIError(500, "the engine aborted this request", code="aborted")
    return final


async def _embed_all(
    engine: Any, items: list[str | list[int]], params: PoolingParams, request_id: str
) -> list[Any]:
    """Every input at once (the engine batches them); the first failure, or a cancel, stops the others
    (closing an engine stream aborts its request and frees its blocks)."""
    tasks = [
        asyncio.ensure_future(_embed_one(engine, item, params, f"{request_id}-{i}"))
        for i, item in enumerate(items)
    ]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def create_embeddings(state: Any, body: EmbeddingRequest, request: Request) -> Response:
    """The whole /v1/embeddings call: validate, run every input on the engine, answer."""
    model_name = check_model(body.model, state.limits)
    items = _inputs(body.input)
    params = pooling_params(body, state.engine.model_config)
    request_id = f"embd-{uuid.uuid4().hex}"
    num_seqs = state.admission.reserve_seqs(len(items))
    try:
        outputs = await run_until_disconnect(
            request.receive, _embed_all(state.engine, items, params, request_id)
        )
    except ClientDisconnected:
        logger.info("client left before %s finished; aborted", request_id)
        return Response(status_code=499)
    except APIError:
        raise
    except Exception:  # fail this request only; the server goes on
        logger.exception("request %s failed", request_id)
        raise internal_error(request_id) from None
    finally:
        state.admission.release(num_seqs)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _vector(out.embedding, body.encoding_format),
        }
        for i, out in enumerate(outputs)
    ]
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )

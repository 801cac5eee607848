"""The FastAPI application: routes, middlewares and the engine's lifetime.

A handler does four things: parse the body (Pydantic), validate it into a
`ValidatedRequest` (`server.validation`), start it on the engine (`server.serving`),
and return JSON or an SSE stream, watching for the client to leave all along.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.engine.input_processor import max_chars_per_token, run_off_loop
from kvserve.server import anthropic_messages, package_version
from kvserve.server.anthropic_messages import (
    CountTokensRequest,
    MessagesRequest,
    build_message,
    messages_input_size,
    messages_sse,
)
from kvserve.server.chat import load_chat_template, render_chat
from kvserve.server.config import ServerConfig
from kvserve.server.embeddings import EmbeddingRequest, EmbeddingResponse, create_embeddings
from kvserve.server.engine_protocol import ModelInfo, ServingEngine
from kvserve.server.errors import (
    APIError,
    bad_request,
    error_response,
    install_error_handlers,
    internal_error,
    shutting_down,
)
from kvserve.server.logprobs import TokenText
from kvserve.server.lora import LoRAModules, add_lora_routes
from kvserve.server.metrics import ServerMetrics
from kvserve.server.middleware import TENANT_SCOPE_KEY, APIKeyMiddleware, BodyLimitMiddleware
from kvserve.server.openapi import errors, install_openapi, named_events, streamed
from kvserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from kvserve.server.reasoning import resolve_reasoning_parser
from kvserve.server.responses import (
    as_responses_request,
    build_response,
    renamed_error,
    responses_input_size,
    responses_sse,
    to_chat_request,
)
from kvserve.server.responses_protocol import ResponsesRequest
from kvserve.server.serving import Admission, Serving, prepend, resolve_max_queue
from kvserve.server.streaming import ClientDisconnected, SSEResponse, run_until_disconnect
from kvserve.server.tokenizer_info import tokenizer_info
from kvserve.server.validation import (
    ModelLimits,
    ValidatedRequest,
    check_model,
    check_num_messages,
    input_size,
    max_tokens_zero_supported,
    messages_size,
    tenant_cache_salt,
    validate_chat,
    validate_completion,
)

logger = logging.getLogger("kvserve.server")
DEFAULT_MODEL_NAME = "kvserve-default"
ENGINE_WATCH_INTERVAL_S = 0.2


def model_path(model_config: ModelInfo) -> str:
    """The checkpoint path (`root` in /v1/models)."""
    return model_config.model_path


@dataclass
class AppState:
    """What the handlers share; built once the engine is up."""

    config: ServerConfig
    engine: ServingEngine
    limits: ModelLimits
    metrics: ServerMetrics
    serving: Serving
    admission: Admission
    created: int
    loras: LoRAModules  # LoRA adapters served by name (server/lora.py)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer


def served_names(config: ServerConfig) -> list[str]:
    return list(config.served_model_name) or [config.model or DEFAULT_MODEL_NAME]


def build_state(
    config: ServerConfig,
    engine: ServingEngine,
    chat_template: str | None,
    loras: LoRAModules | None = None,
) -> AppState:
    model_config = engine.model_config
    names = served_names(config)
    loras = loras or LoRAModules({}, names, config.max_lora_rank)
    limits = ModelLimits(
        served_model_names=names,
        max_model_len=model_config.max_model_len,
        vocab_size=model_config.vocab_size,
        chat_template=chat_template or engine.chat_template,
        max_tokens_zero_ok=max_tokens_zero_supported(),
        kv_capacity_tokens=engine.stats().num_kv_blocks_total * model_config.block_size,
        max_chars_per_token=max_chars_per_token(engine.tokenizer),
        max_chat_messages=config.max_chat_messages,
        tool_call_parser=None if config.tool_call_parser == "none" else config.tool_call_parser,
        max_tools=config.max_tools,
        grammar_limits=config.grammar_limits(),
        is_encoder_decoder=model_config.decoder_start_token_id is not None,
        decoder_start_token_id=model_config.decoder_start_token_id,
        reasoning_parser=resolve_reasoning_parser(
            config.reasoning_parser, chat_template or engine.chat_template
        ),
        scheduling_policy=config.scheduling_policy,
        generation_config=model_config.generation_config,
        lora_adapters=loras.adapters,
    )
    metrics = ServerMetrics(engine, names[0])
    max_queue = resolve_max_queue(
        config.max_queue, config.max_num_seqs, engine.stats().num_kv_blocks_total
    )
    return AppState(
        config=config,
        engine=engine,
        limits=limits,
        metrics=metrics,
        serving=Serving(engine, metrics, TokenText(engine.tokenizer)),
        admission=Admission(engine, max_queue, config.max_num_seqs),
        created=int(time.time()),
        loras=loras,
    )


def log_startup(state: AppState) -> None:
    mc, stats = state.engine.model_config, state.engine.stats()
    logger.info(
        "model %s served as %s: dtype=%s device=%s max_model_len=%d weights=%s (%.1f MiB)",
        model_path(mc),
        ", ".join(state.limits.served_model_names),
        mc.dtype,
        mc.device,
        mc.max_model_len,
        mc.quantization,
        mc.weight_bytes / 2**20,
    )
    logger.info(
        "KV cache: %d blocks, capacity %d tokens; max_num_seqs=%d; at most %s sequences wait (--max-queue %s)",
        stats.num_kv_blocks_total,
        state.limits.kv_capacity_tokens,
        state.config.max_num_seqs,
        "any number of" if state.admission.max_queue is None else state.admission.max_queue,
        state.config.max_queue,
    )
    if state.limits.reasoning_parser is not None:
        logger.info(
            "reasoning parser: %s (--reasoning-parser %s)",
            state.limits.reasoning_parser.name,
            state.config.reasoning_parser,
        )
    logger.info(
        "serving on http://%s:%d (OpenAI base URL http://%s:%d/v1)",
        state.config.host,
        state.config.port,
        state.config.host,
        state.config.port,
    )


def create_app(
    config: ServerConfig, engine: ServingEngine | None = None, owns_engine: bool = False
) -> FastAPI:
    """The ASGI app. Without `engine`, an `AsyncLLM` is built from `config` at start-up. An engine
    the app owns (built here, or passed with `owns_engine=True`, e.g. one started early with
    `AsyncLLM(..., wait=False)`) is awaited at start-up, shut down at exit, and watched: if it
    dies, the server stops."""
    chat_template = load_chat_template(config.chat_template)
    loras = LoRAModules({}, served_names(config), config.max_lora_rank)
    loras.load_modules(config.lora_modules)  # a bad adapter stops the start before the engine loads

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = engine is None or owns_engine
        if engine is None:
            from kvserve.engine import AsyncLLM, EngineArgs

            the_engine: ServingEngine = AsyncLLM(EngineArgs(**config.engine_kwargs()), wait=False)
        else:
            the_engine = engine
        if owned:
            try:
                await asyncio.to_thread(the_engine.wait_ready)
            except BaseException:
                await the_engine.shutdown()
                raise
        state = build_state(config, the_engine, chat_template, loras)
        app.state.kv = state
        log_startup(state)
        tasks = [asyncio.create_task(state.metrics.run_stats_logger(config.stats_log_interval))]
        if owned:
            tasks.append(
                asyncio.create_task(
                    _exit_when_engine_dies(app, the_engine, config.keep_alive_on_engine_death)
                )
            )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if owned:
                await the_engine.shutdown()

    app = FastAPI(title="kvserve", version=package_version(), lifespan=lifespan)
    install_error_handlers(app)
    _add_routes(app)
    if config.allow_runtime_lora_updating:
        add_lora_routes(app, lambda request: request.app.state.kv.loras)
    install_openapi(
        app, has_api_key=bool(config.api_key), protects_metrics=config.metrics_require_api_key
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(
            APIKeyMiddleware,
            api_keys=config.api_key,
            protect_metrics=config.metrics_require_api_key,
            tag_tenants=config.cache_salt_per_api_key,
        )
    if config.cors_origin:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origin,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in config.cors_origin,
        )
    return app


async def _exit_when_engine_dies(
    app: FastAPI, engine: ServingEngine, keep_alive: bool = False
) -> None:
    """A dead engine never recovers: fail fast so that an orchestrator restarts the server.

    `/health` answers 503 from the moment the engine is dead; the CLI sets
    `app.state.request_exit` and exits non-zero once uvicorn has stopped (unless
    `keep_alive`: `--keep-alive-on-engine-death`). An engine stopped by the drain is not dead.
    """
    while engine.is_healthy:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    if app.state.kv.admission.is_closed and engine.error is None:
        return  # the server is shutting down (server.drain) and stopped the engine itself
    app.state.engine_failed = True
    if keep_alive:
        logger.error(
            "the engine is dead; --keep-alive-on-engine-death keeps the server up (/health 503)"
        )
        return
    logger.error("the engine is dead; shutting the server down")
    request_exit = getattr(app.state, "request_exit", None)
    if request_exit is not None:
        request_exit()


CompleteFn = Callable[
    [ValidatedRequest, AsyncGenerator[tuple[int, Any], None]], Awaitable[dict[str, Any]]
]
EventsFn = Callable[
    [ValidatedRequest, Any, AsyncGenerator[tuple[int, Any], None]], AsyncGenerator[str, None]
]


async def run_request(
    state: AppState,
    vreq: ValidatedRequest,
    request: Request,
    complete: CompleteFn | None = None,
    events: EventsFn | None = None,
) -> Response:
    """Admit, start on the engine, and answer as JSON or SSE; abort if the client leaves.
    `complete` and `events` shape the body and the stream (default: OpenAI's completions and chat)."""
    complete = complete or state.serving.complete
    make_events = events or state.serving.events
    tenant = request.scope.get(TENANT_SCOPE_KEY)  # set by --cache-salt-per-api-key
    if tenant is not None:
        vreq = dataclasses.replace(vreq, cache_salt=tenant_cache_salt(tenant, vreq.cache_salt))
    lora = state.limits.lora_adapters.get(vreq.model_name)
    if lora is not None:
        vreq = dataclasses.replace(vreq, lora_request=lora)
    num_seqs = state.admission.reserve(vreq)
    lora_gauge = state.metrics.lora_gauge(
        vreq.lora_request.lora_name if vreq.lora_request else None
    )
    if lora_gauge is not None:
        lora_gauge.inc()

    def release() -> None:
        state.admission.release(num_seqs)
        if lora_gauge is not None:
            lora_gauge.dec()

    outputs = state.serving.outputs(vreq)
    is_handed_over = False
    try:
        if not vreq.is_stream:
            body = await run_until_disconnect(request.receive, complete(vreq, outputs))
            return JSONResponse(body)

        async def first_output() -> Any:
            return await anext(outputs, None)

        first = await run_until_disconnect(
            request.receive, first_output()
        )  # engine refusals are still a 400
        stream = make_events(vreq, first, outputs)

        async def release_after() -> AsyncGenerator[str, None]:
            try:
                async for event in stream:
                    yield event
            finally:
                await stream.aclose()
                await outputs.aclose()
                release()

        is_handed_over = True
        return SSEResponse(release_after())
    except ClientDisconnected:
        logger.info("client left before %s finished; aborted", vreq.request_id)
        return Response(status_code=499)
    except APIError:
        raise
    except Exception:  # fail this request only; the server goes on
        logger.exception("request %s failed", vreq.request_id)
        return error_response(internal_error(vreq.request_id), request.url.path)
    finally:
        if not is_handed_over:
            await outputs.aclose()
            release()


def _add_routes(app: FastAPI) -> None:
    def kv(request: Request) -> AppState:
        return request.app.state.kv

    @app.post(
        "/v1/completions",
        responses={
            **streamed(CompletionResponse, CompletionResponse),
            **errors(400, 404, 413, 500, 503),
        },
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state = kv(request)
        vreq = await run_off_loop(
            validate_completion, body, state.limits, state.tokenizer, num_chars=input_size(body)
        )
        return await run_request(state, vreq, request)

    @app.post(
        "/v1/chat/completions",
        responses={
            **streamed(ChatCompletionResponse, ChatCompletionChunk),
            **errors(400, 404, 413, 500, 503),
        },
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state = kv(request)
        vreq = await run_off_loop(
            validate_chat, body, state.limits, state.tokenizer, num_chars=input_size(body)
        )
        return await run_request(state, vreq, request)

    @app.post(
        "/v1/responses",
        responses={
            **named_events(
                "The response object (JSON), or with `stream: true` the Responses API's named events "
                "(`response.created` ... `response.completed`)"
            ),
            **errors(400, 404, 413, 500, 503),
        },
    )
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        state = kv(request)
        vreq = await run_off_loop(
            _validate_responses, state, body, num_chars=responses_input_size(body)
        )

        async def complete(
            vreq: ValidatedRequest, outputs: AsyncGenerator[tuple[int, Any], None]
        ) -> dict[str, Any]:
            return build_response(body, vreq, await state.serving.chat_response(vreq, outputs))

        def events(
            vreq: ValidatedRequest, first: Any, outputs: AsyncGenerator[tuple[int, Any], None]
        ) -> AsyncGenerator[str, None]:
            return responses_sse(
                state.serving.chat_chunks(vreq, prepend(first, outputs)), body, vreq
            )

        return await run_request(state, vreq, request, complete, events)

    @app.post(
        "/v1/messages",
        responses={
            **named_events(
                "The message (JSON), or with `stream: true` Anthropic's named events (`message_start` ... "
                "`message_stop`); errors in Anthropic's shape"
            ),
            **errors(400, 404, 413, 500, 503, anthropic=True),
        },
    )
    async def messages(body: MessagesRequest, request: Request) -> Response:
        state = kv(request)
        vreq = await run_off_loop(
            _validate_messages, state, body, num_chars=messages_input_size(body)
        )

        async def complete(
            vreq: ValidatedRequest, outputs: AsyncGenerator[tuple[int, Any], None]
        ) -> dict[str, Any]:
            return build_message(vreq, await state.serving.chat_response(vreq, outputs))

        def events(
            vreq: ValidatedRequest, first: Any, outputs: AsyncGenerator[tuple[int, Any], None]
        ) -> AsyncGenerator[str, None]:
            return messages_sse(state.serving.chat_chunks(vreq, prepend(first, outputs)), vreq)

        return await run_request(state, vreq, request, complete, events)

    @app.post(
        "/v1/embeddings",
        responses={200: {"model": EmbeddingResponse}, **errors(400, 404, 413, 500, 503)},
    )
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embeddings(kv(request), body, request)

    @app.post("/v1/messages/count_tokens", responses=errors(400, 404, 413, anthropic=True))
    async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
        state = kv(request)
        vreq = await run_off_loop(
            _validate_messages, state, body, num_chars=messages_input_size(body)
        )
        return {"input_tokens": len(vreq.prompts[0].token_ids)}

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state = kv(request)
        cards = [_model_card(state, name) for name in state.limits.served_model_names]
        return ModelList(
            data=cards + state.loras.model_cards(state.created, state.limits.max_model_len)
        )

    @app.get("/v1/models/{model:path}", responses=errors(404))
    async def model(model: str, request: Request) -> ModelCard:
        state = kv(request)
        check_model(model, state.limits)
        if model in state.limits.lora_adapters:
            return next(
                c
                for c in state.loras.model_cards(state.created, state.limits.max_model_len)
                if c.id == model
            )
        return _model_card(state, model)

    @app.get(
        "/health",
        responses={
            200: {"content": {"application/json": {"example": {"status": "ok"}}}},
            **errors(503),
        },
    )
    async def health(request: Request) -> Response:
        state = kv(request)
        if state.admission.is_closed:
            raise shutting_down()  # load balancers stop sending while the server drains
        if state.engine.is_healthy:
            return JSONResponse({"status": "ok"})
        raise APIError(503, "the engine loop has stopped", code="engine_dead")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        return Response(kv(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.post("/tokenize", responses=errors(400, 404, 413))
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        state = kv(request)
        check_model(body.model, state.limits)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            check_num_messages(body.messages, state.limits)
        size = len(body.prompt) if body.prompt is not None else messages_size(body.messages or [])
        tokens = await run_off_loop(_tokenize, state, body, num_chars=size)
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=state.limits.max_model_len
        )

    @app.post("/detokenize", responses=errors(400, 404, 413))
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state = kv(request)
        check_model(body.model, state.limits)
        for token_id in body.tokens:
            if not 0 <= token_id < state.limits.vocab_size:
                raise bad_request(f"token id {token_id} is outside the vocabulary", param="tokens")
        text = await run_off_loop(
            state.tokenizer.decode, body.tokens, num_chars=4 * len(body.tokens)
        )
        return DetokenizeResponse(prompt=text)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request) -> TokenizerInfoResponse:
        state = kv(request)
        return tokenizer_info(
            state.tokenizer, state.limits.chat_template, state.limits.max_model_len
        )


def _validate_responses(state: AppState, body: ResponsesRequest) -> ValidatedRequest:
    chat = to_chat_request(body)
    try:
        vreq = validate_chat(chat, state.limits, state.tokenizer)
    except APIError as exc:
        raise renamed_error(exc) from None
    return as_responses_request(vreq)


def _validate_messages(state: AppState, body: CountTokensRequest) -> ValidatedRequest:
    chat = anthropic_messages.to_chat_request(body)
    try:
        vreq = validate_chat(chat, state.limits, state.tokenizer)
    except APIError as exc:
        raise anthropic_messages.renamed_error(exc) from None
    return anthropic_messages.as_messages_request(vreq)


def _tokenize(state: AppState, body: TokenizeRequest) -> list[int]:
    """/tokenize's work (run off the event loop for big inputs)."""
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(state.tokenizer.encode(body.prompt, add_special_tokens=add_special))
    text = render_chat(state.tokenizer, state.limits.chat_template, body.messages or [])
    return list(state.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))


def _model_card(state: AppState, name: str) -> ModelCard:
    return ModelCard(
        id=name,
        created=state.created,
        root=model_path(state.engine.model_config),
        max_model_len=state.limits.max_model_len,
    )

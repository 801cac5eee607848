"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API), on the chat path.

A request becomes a chat request (`to_chat_request`): `system` as a system message, text,
`tool_use` and `tool_result` blocks as chat messages and tool calls, tools as function tools,
`tool_choice` auto/any/tool/none as auto/required/named/none, `thinking` as the template's
`enable_thinking`. The chat result is reshaped into content blocks (`thinking`, `text`,
`tool_use`) and a stream into Anthropic's events (`MessageEvents`). Errors on these routes have
Anthropic's shape (server/errors.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictStr

from kvserve.server.chat_output import chat_request
from kvserve.server.errors import APIError, anthropic_error_body, bad_request, internal_error
from kvserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    JsonInt,
    UsageInfo,
    _Request,
    json_int,
)
from kvserve.server.streaming import named_sse_event
from kvserve.server.validation import ValidatedRequest

logger = logging.getLogger("kvserve.server")

_PARAMS = {
    "messages": "messages",
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "reasoning_effort": "output_config.effort",
}


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: StrictStr | list[dict[str, Any]]


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: JsonInt | None = None


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(_Request):
    model: StrictStr | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # kvserve's, as in chat


class MessagesRequest(CountTokensRequest):
    max_tokens: json_int(ge=1)
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = False
    temperature: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: json_int(ge=0) | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _block_text(content: Any, param: str) -> str:
    """A string, or text blocks joined with newlines; 400 for other blocks (images, documents)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content if isinstance(content, list) else [content]):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(
                f"{param}.{j}: block type {kind!r} is not supported here (only text)", param=param
            )
        texts.append(block["text"])
    return "\n".join(texts)


def _turn(i: int, message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (before the
    user's text); tool_use blocks become the assistant's tool calls; thinking blocks are dropped."""
    param = f"messages.{i}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(message.content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{param}.{j}: tool_use needs a string id and name", param=param)
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and message.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(
                    f"{param}.{j}: tool_result needs a string tool_use_id", param=param
                )
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _block_text(block.get("content") or "", f"{param}.{j}.content"),
                }
            )
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue
        else:
            raise bad_request(
                f"{param}.{j}: block type {kind!r} is not supported in a {message.role} message",
                param=param,
            )
    turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if texts or calls or not results else [])


def _tools(req: CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    tools = None
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type", "custom") != "custom":
                raise bad_request(
                    f"tools.{i}: tool type {tool.get('type')!r} is not supported (only custom tools "
                    "with an input_schema)",
                    param="tools",
                )
            function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if "description" in tool:
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
    asked, parallel = req.tool_choice, None
    choice: dict[str, Any] | str | None = asked
    if asked is not None:
        kind = asked.get("type")
        parallel = False if asked.get("disable_parallel_tool_use") else None
        if kind == "tool" and isinstance(asked.get("name"), str):
            choice = {"type": "function", "function": {"name": asked["name"]}}
        elif kind in ("auto", "any", "none"):
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad_request(
                'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} '
                'or {"type": "tool", "name": ...}',
                param="tool_choice",
            )
    return tools, choice, parallel


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that runs `req` (count_tokens: renders it); 400 naming the Anthropic field."""
    messages = (
        [{"role": "system", "content": _block_text(req.system, "system")}] if req.system else []
    )
    for i, message in enumerate(req.messages):
        messages += _turn(i, message)
    tools, tool_choice, parallel = _tools(req)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None and req.thinking.type != "adaptive":
        template_kwargs["enable_thinking"] = req.thinking.type == "enabled"
    fields["chat_template_kwargs"] = template_kwargs or None
    if req.output_config is not None and req.output_config.effort is not None:
        effort = req.output_config.effort
        fields["reasoning_effort"] = "xhigh" if effort == "max" else effort
    if req.output_config is not None and req.output_config.format is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": req.output_config.format.schema_},
        }
    if isinstance(req, MessagesRequest):
        fields.update(
            max_completion_tokens=req.max_tokens,
            stop=req.stop_sequences,
            stream=req.stream,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
        )
    return chat_request(fields, _PARAMS)


def as_messages_request(vreq: ValidatedRequest) -> ValidatedRequest:
    return dataclasses.replace(vreq, request_id=_new_id("msg"), include_usage=True)


def renamed_error(exc: APIError) -> APIError:
    if exc.param is not None:
        exc.param = _PARAMS.get(exc.param.split(".")[0], exc.param)
    return exc


# ----------------------------------------------------------------------------- the response


def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the output)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage_body(usage: UsageInfo | None) -> dict[str, Any]:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens not found cached."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def build_message(vreq: ValidatedRequest, chat: ChatCompletionResponse) -> dict[str, Any]:
    choice = chat.choices[0]
    message = choice.message
    content: list[dict[str, Any]] = []
    if message.reasoning_content is not None:
        content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        content.append({"type": "text", "text": message.content})
    for call in message.tool_calls or []:
        content.append(
            {
                "type": "tool_use",
                "id": call.id.replace("call_", "toolu_", 1),
                "name": call.function.name,
                "input": _tool_input(call.function.arguments),
            }
        )
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    return {
        "id": vreq.request_id,
        "type": "message",
        "role": "assistant",
        "model": vreq.model_name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(chat.usage),
    }


class MessageEvents:
    """Chat chunks in, Anthropic stream events out: one content block per thinking run, text run
    and tool call, each started at its first delta and stopped before the next one starts."""

    def __init__(self, vreq: ValidatedRequest) -> None:
        self.vreq = vreq
        self.index = -1  # the open block's index
        self.open_kind: str | None = None
        self.open_call_index: int | None = None

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        message: dict[str, Any] = {
            "id": self.vreq.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.vreq.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(self.vreq.prompts[0].token_ids), "output_tokens": 0},
        }
        return [
            ("message_start", {"type": "message_start", "message": message}),
            ("ping", {"type": "ping"}),
        ]

    def _open(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self.index += 1
        self.open_kind = kind
        return [
            *events,
            (
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            ),
        ]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open_kind is None:
            return []
        events = []
        if self.open_kind == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open_kind, self.open_call_index = None, None
        return [
            *events,
            ("content_block_stop", {"type": "content_block_stop", "index": self.index}),
        ]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": self.index,
            "delta": delta,
        }

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if delta.get("reasoning_content"):
            if self.open_kind != "thinking":
                events += self._open(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            events.append(
                self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            )
        if delta.get("content"):
            if self.open_kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            if call["index"] != self.open_call_index:
                block = {
                    "type": "tool_use",
                    "id": call["id"].replace("call_", "toolu_", 1),
                    "name": call["function"]["name"],
                    "input": {},
                }
                events += self._open("tool_use", block)
                self.open_call_index = call["index"]
            if call["function"].get("arguments"):
                events.append(
                    self._delta(
                        {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
                    )
                )
        return events

    def finish(
        self, finish_reason: str | None, stop: int | str | None, usage: UsageInfo | None
    ) -> list[tuple[str, dict[str, Any]]]:
        reason, sequence = stop_reason(finish_reason, stop)
        return [
            *self._close(),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage_body(usage),
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]


async def messages_sse(
    chunks: AsyncIterator[ChatCompletionChunk], vreq: ValidatedRequest
) -> AsyncGenerator[str, None]:
    """The SSE stream; an error after the start becomes an `error` event (no message text of a 500)."""
    writer = MessageEvents(vreq)
    try:
        for name, event in writer.start():
            yield named_sse_event(name, event)
        finish_reason, stop, usage = None, None, None
        async for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                for name, event in writer.feed(choice.delta):
                    yield named_sse_event(name, event)
                finish_reason = choice.finish_reason or finish_reason
                stop = choice.stop_reason if choice.stop_reason is not None else stop
        for name, event in writer.finish(finish_reason, stop, usage):
            yield named_sse_event(name, event)
    except Exception as exc:
        if not isinstance(exc, APIError):
            logger.exception("request %s failed mid-stream", vreq.request_id)
            exc = internal_error(vreq.request_id)
        yield named_sse_event("error", anthropic_error_body(exc.status_code, exc.message))


def messages_input_size(req: CountTokensRequest) -> int:
    """Roughly how many characters validating `req` renders (small ones run inline)."""
    return len(str(req.system or "")) + sum(
        64 + len(m.content if isinstance(m.content, str) else str(m.content)) for m in req.messages
    )

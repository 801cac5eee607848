"""`POST /v1/responses` (OpenAI's Responses API), stateless, on the chat path.

A request becomes a chat request (`to_chat_request`: `instructions` and `input` items as
messages, function tools, `text.format` as `response_format`, `reasoning.effort` to the
template), is validated and run as chat, and its result is reshaped: a reasoning item (with
`--reasoning-parser`), a message with `output_text`, one `function_call` item per call.
Streams are the chat chunks turned into the Responses event sequence (`ResponseEvents`).
Nothing is stored, so `previous_response_id` is a 400.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvserve.server.chat_output import chat_request
from kvserve.server.errors import APIError, bad_request, internal_error
from kvserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    UsageInfo,
)
from kvserve.server.responses_protocol import ResponsesRequest
from kvserve.server.streaming import named_sse_event
from kvserve.server.validation import ValidatedRequest

logger = logging.getLogger("kvserve.server")

# chat field -> the Responses field it came from, for the `param` of a 400
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "top_logprobs": "top_logprobs",
}
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_IGNORED_INCLUDES = {"reasoning.encrypted_content"}  # reasoning comes back as plain text anyway


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; send the whole "
            "conversation in input",
            param="previous_response_id",
        )
    for name in ("background", "conversation", "prompt"):
        if getattr(req, name) not in (None, False):
            raise bad_request(f"{name} is not supported by this server", param=name)
    if req.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: an input over the context is refused "
            "(use 'disabled')",
            param="truncation",
        )
    if req.top_logprobs:
        raise bad_request(
            "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
            param="top_logprobs",
        )
    unknown = [item for item in req.include or [] if item not in _IGNORED_INCLUDES]
    if unknown:
        raise bad_request(f"include {unknown} is not supported", param="include")


def _text(content: Any, param: str) -> str:
    """A message's or tool output's content: a string, or text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in _TEXT_PART_TYPES
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{param}.{j}: content part {kind!r} is not supported (only text parts)",
                param=param,
            )
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages; consecutive function calls share one assistant turn."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message" if "role" in item else None)
        param = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{param}.role must be user, system, developer or assistant, got {role!r}",
                    param=param,
                )
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text(item.get("content"), f"{param}.content"),
                }
            )
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise bad_request(
                    f"{param}: a function_call needs string call_id, name and arguments",
                    param=param,
                )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(
                    f"{param}: a function_call_output needs a string call_id", param=param
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"{param}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again (as chat templates drop it)
        else:
            raise bad_request(
                f"{param}: input item type {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
                param=param,
            )
    if not messages:
        raise bad_request("input is empty", param="input")
    return messages


def _chat_tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = None
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise bad_request(
                    f"tools.{i}: tool type {tool.get('type')!r} is not supported (only function tools)",
                    param="tools",
                )
            function = {
                key: tool[key] for key in ("name", "description", "parameters") if key in tool
            }
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                '"name": ...}',
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that runs `req`; 400 (naming the Responses field) for what cannot be honoured."""
    _refuse_unsupported(req)
    tools, tool_choice = _chat_tools(req)
    fields = {
        "model": req.model,
        "messages": input_messages(req),
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "seed": req.seed,
        "priority": req.priority,
        "cache_salt": req.cache_salt,
        "user": req.user,
        "chat_template_kwargs": req.chat_template_kwargs,
        "response_format": _response_format(req),
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
    }
    return chat_request(fields, _PARAMS)


def as_responses_request(vreq: ValidatedRequest) -> ValidatedRequest:
    """A validated chat request as a Responses one: its id, and usage always reported."""
    return dataclasses.replace(vreq, request_id=_new_id("resp"), include_usage=True)


def renamed_error(exc: APIError) -> APIError:
    """A chat validation error with its `param` named as in the Responses request."""
    if exc.param is not None:
        head = exc.param.split(".")[0]
        exc.param = _PARAMS.get(head, exc.param)
    return exc


# ----------------------------------------------------------------------------- the response


def usage_body(usage: UsageInfo | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    reasoning = (
        usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
    )
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.total_tokens,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = (
        []
        if text is None
        else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    )
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_body(
    req: ResponsesRequest,
    vreq: ValidatedRequest,
    output: list[dict[str, Any]],
    status: str,
    usage: UsageInfo | None,
    created: int,
) -> dict[str, Any]:
    """The response object (also the payload of the lifecycle events)."""
    fmt = (
        req.text.format.model_dump(by_alias=True, exclude_none=True)
        if req.text and req.text.format
        else None
    )
    return {
        "id": vreq.request_id,
        "object": "response",
        "created_at": created,
        "model": vreq.model_name,
        "status": status,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "text": {"format": fmt or {"type": "text"}},
        "reasoning": req.reasoning.model_dump() if req.reasoning else None,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "user": req.user,
        "usage": usage_body(usage),
    }


def build_response(
    req: ResponsesRequest, vreq: ValidatedRequest, chat: ChatCompletionResponse
) -> dict[str, Any]:
    """The whole (non-streamed) response from the chat result."""
    choice = chat.choices[0]
    message = choice.message
    output: list[dict[str, Any]] = []
    if message.reasoning_content is not None:
        output.append(reasoning_item(_new_id("rs"), message.reasoning_content))
    if message.content:
        output.append(message_item(_new_id("msg"), message.content))
    for call in message.tool_calls or []:
        output.append(
            call_item(_new_id("fc"), call.id, call.function.name, call.function.arguments)
        )
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    return response_body(req, vreq, output, status, chat.usage, chat.created)


class ResponseEvents:
    """Chat chunks in, Responses stream events out: lifecycle events around one output item per
    reasoning block, message and function call, each opened when its first delta comes and closed
    before the next one opens."""

    def __init__(self, req: ResponsesRequest, vreq: ValidatedRequest) -> None:
        self.req, self.vreq = req, vreq
        self.created = int(time.time())
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open_item: dict[str, Any] | None = None
        self.open_call_index: int | None = (
            None  # the chat tool call index the open function_call item is
        )

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return payload

    def start(self) -> list[dict[str, Any]]:
        body = response_body(self.req, self.vreq, [], "in_progress", None, self.created)
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    @property
    def _current(self) -> dict[str, Any]:
        """The open output item, after `_open`."""
        assert self.open_item is not None
        return self.open_item

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.open_item = item
        index = len(self.output)
        events.append(
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress"},
            )
        )
        part = {
            "reasoning": {"type": "reasoning_text", "text": ""},
            "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        }.get(item["type"])
        if part is not None:
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self.open_item, self.open_call_index = self.open_item, None, None
        if item is None:
            return []
        index, events = len(self.output), []
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"] if item["content"] else ""
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part={"type": "reasoning_text", "text": text},
                )
            )
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        self.output.append(item)
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat delta."""
        events: list[dict[str, Any]] = []
        index = len(self.output)
        if delta.get("reasoning_content"):
            if self.open_item is None or self.open_item["type"] != "reasoning":
                events += self._open(reasoning_item(_new_id("rs"), "", status="completed"))
                self._current["content"] = [{"type": "reasoning_text", "text": ""}]
                index = len(self.output)
            self._current["content"][0]["text"] += delta["reasoning_content"]
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self._current["id"],
                    output_index=index,
                    content_index=0,
                    delta=delta["reasoning_content"],
                )
            )
        if delta.get("content"):
            if self.open_item is None or self.open_item["type"] != "message":
                events += self._open(message_item(_new_id("msg"), ""))
                index = len(self.output)
            self._current["content"][0]["text"] += delta["content"]
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self._current["id"],
                    output_index=index,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            )
        for call in delta.get("tool_calls") or []:
            if call["index"] != self.open_call_index:  # a new call: its header carries id and name
                events += self._open(
                    call_item(_new_id("fc"), call["id"], call["function"]["name"], "")
                )
                self.open_call_index = call["index"]
            arguments = call["function"].get("arguments") or ""
            if arguments:
                self._current["arguments"] += arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self._current["id"],
                        output_index=len(self.output),
                        delta=arguments,
                    )
                )
        return events

    def finish(self, finish_reason: str | None, usage: UsageInfo | None) -> list[dict[str, Any]]:
        events = self._close()
        status = "incomplete" if finish_reason == "length" else "completed"
        body = response_body(self.req, self.vreq, self.output, status, usage, self.created)
        body["completed_at"] = int(time.time()) if status == "completed" else None
        return [*events, self.event(f"response.{status}", response=body)]


async def response_events(
    req: ResponsesRequest, vreq: ValidatedRequest, chunks: AsyncIterator[ChatCompletionChunk]
) -> AsyncIterator[dict[str, Any]]:
    """The Responses events of a streamed chat request's chunks (one choice)."""
    writer = ResponseEvents(req, vreq)
    for event in writer.start():
        yield event
    finish_reason, usage = None, None
    async for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            for event in writer.feed(choice.delta):
                yield event
            finish_reason = choice.finish_reason or finish_reason
    for event in writer.finish(finish_reason, usage):
        yield event


async def responses_sse(
    chunks: AsyncIterator[ChatCompletionChunk], req: ResponsesRequest, vreq: ValidatedRequest
) -> AsyncGenerator[str, None]:
    """The SSE stream; an error after the start becomes an `error` event (no message text of a 500)."""
    sequence_number = 0
    try:
        async for event in response_events(req, vreq, chunks):
            sequence_number = event["sequence_number"] + 1
            yield named_sse_event(event["type"], event)
    except Exception as exc:
        if not isinstance(exc, APIError):
            logger.exception("request %s failed mid-stream", vreq.request_id)
            exc = internal_error(vreq.request_id)
        yield named_sse_event(
            "error",
            {
                "type": "error",
                "code": exc.code,
                "message": exc.message,
                "param": exc.param,
                "sequence_number": sequence_number,
            },
        )


def responses_input_size(req: ResponsesRequest) -> int:
    """Roughly how many characters validating `req` renders (small ones run inline)."""
    items = [req.input] if isinstance(req.input, str) else req.input
    return len(req.instructions or "") + sum(
        64 + (len(i) if isinstance(i, str) else len(str(i))) for i in items
    )

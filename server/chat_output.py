"""A chat choice's text read as what the model meant: reasoning, answer and tool calls.

The reasoning parser (server/reasoning.py) goes first; tool-call parsing (server/tool_parsers.py)
sees the answer only. `read_choice` does it for a finished choice, `ChoiceStreamer` piece by piece
as chat deltas (`reasoning_content`, `content`, `tool_calls`), so that a stream carries exactly
the whole response's parts. /v1/responses and /v1/messages reshape these same results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.reasoning import ReasoningStreamer, num_reasoning_tokens, split_reasoning
from kvserve.server.tool_parsers import FunctionCall, ToolStreamer, extract_tool_calls
from kvserve.server.validation import ValidatedRequest


def chat_request(fields: dict[str, Any], params: dict[str, str]) -> ChatCompletionRequest:
    """Another API's request as the chat request it runs as (None fields left out); a validation
    error is a 400 whose `param` is renamed through `params` to the route's own field name."""
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(
            f"{where}: {first['msg']}", param=params.get(str(first["loc"][0]))
        ) from None


@dataclass(frozen=True, slots=True)
class ChoiceParts:
    """A finished choice: `content` None when there is no answer text, `reasoning` None when the
    model did not think."""

    content: str | None
    reasoning: str | None
    calls: list[FunctionCall]
    num_reasoning_tokens: int


def _reasoning_tokens(
    vreq: ValidatedRequest,
    token_ids: list[int],
    has_reasoning: bool,
    is_ended: bool,
    decode: Callable[[list[int]], str],
) -> int:
    if not has_reasoning or vreq.reasoning is None:
        return 0
    return num_reasoning_tokens(token_ids, decode, vreq.reasoning.end, is_ended)


def read_choice(
    vreq: ValidatedRequest, text: str, token_ids: list[int], decode: Callable[[list[int]], str]
) -> ChoiceParts:
    """The parts of a finished choice's whole `text`."""
    reasoning, is_ended = None, False
    if vreq.reasoning is not None:
        reasoning, text, is_ended = split_reasoning(vreq.reasoning, vreq.reasoning_state, text)
    content: str | None = text
    calls: list[FunctionCall] = []
    if vreq.tools is not None:
        content, calls = extract_tool_calls(text, vreq.tools)
    num_reasoning = _reasoning_tokens(vreq, token_ids, reasoning is not None, is_ended, decode)
    return ChoiceParts(
        content=(content or None) if reasoning is not None else content,
        reasoning=reasoning,
        calls=calls,
        num_reasoning_tokens=num_reasoning,
    )


class ChoiceStreamer:
    """One streamed choice as chat deltas. `feed` takes the engine's new text; `finish` the whole
    output, and returns the last deltas and whether the choice made tool calls."""

    def __init__(self, vreq: ValidatedRequest) -> None:
        self.vreq = vreq
        self.reasoning = (
            ReasoningStreamer(vreq.reasoning, vreq.reasoning_state)
            if vreq.reasoning is not None
            else None
        )
        self.tools = ToolStreamer(vreq.tools) if vreq.tools is not None else None
        self.answer = ""
        self.num_reasoning_tokens = 0

    def _deltas(self, reasoning: str, answer: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        self.answer += answer
        content = answer
        call_deltas: list[dict[str, Any]] = []
        if self.tools is not None:
            content, call_deltas = self.tools.feed(answer)
        if content:
            deltas.append({"content": content})
        return deltas + call_deltas

    def feed(self, text: str) -> list[dict[str, Any]]:
        reasoning, answer = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._deltas(reasoning, answer)

    def finish(
        self, token_ids: list[int], decode: Callable[[list[int]], str]
    ) -> tuple[list[dict[str, Any]], bool]:
        deltas: list[dict[str, Any]] = []
        if self.reasoning is not None:
            deltas = self._deltas(*self.reasoning.finish())
            self.num_reasoning_tokens = _reasoning_tokens(
                self.vreq,
                token_ids,
                self.reasoning.has_reasoning,
                self.reasoning.is_reasoning_ended,
                decode,
            )
        if self.tools is None:
            return deltas, False
        rest, call_deltas, made_calls = self.tools.finish(self.answer)
        deltas += call_deltas
        if rest:
            deltas.append({"content": rest})
        return deltas, made_calls

"""HTTP schemas of `POST /v1/responses` (OpenAI's Responses API), the request side.

Types and ranges are checked here; `server.responses` maps the request onto a chat request
(and refuses what it cannot honour). The response body and events are built as plain dicts in
OpenAI's shapes there, since clients parse them with the openai SDK's own types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictStr

from kvserve.server.protocol import JsonInt, ReasoningEffort, _Request, json_int


class ResponsesTextFormat(_Request):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class ResponsesText(_Request):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesReasoning(_Request):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    """The fields kvserve reads; those it cannot honour are refused in `server.responses`."""

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    max_output_tokens: json_int(ge=1) | None = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool | None = False
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    # accepted with the one value kvserve honours (else a 400 naming the field)
    store: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: StrictStr | None = None
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[StrictStr] | None = None
    top_logprobs: json_int(ge=0, le=20) | None = None
    max_tool_calls: json_int(ge=1) | None = None
    # kvserve's (as in chat)
    seed: JsonInt | None = None
    priority: JsonInt | None = None
    cache_salt: StrictStr | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None

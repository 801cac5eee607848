"""HTTP schemas (Pydantic), mirroring the OpenAI API.

Request models check types and ranges only; `server.validation` turns a parsed request
into the engine-facing `ValidatedRequest` (tokenized, length-checked). Unknown request
fields are ignored, as most OpenAI-compatible servers do; fields whose meaning we cannot
honour (`suffix`, `best_of` other than n) are rejected there.

A lone UTF-16 surrogate in any request string (`"a\\ud800b"`: JSON allows it, UTF-8 cannot
encode it, JavaScript produces it by slicing an emoji) is replaced by U+FFFD before anything
reads the request, as OpenAI does: the tokenizer and the JSON encoder never see it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from kvserve.engine.input_processor import check_cache_salt
from kvserve.engine.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

MAX_LOGPROBS = 20
MAX_N = 128
MAX_SEQS_PER_REQUEST = 4096  # prompts x n: one request must not flood the engine
MAX_STOP = 16


def _integral_float_to_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_int(**bounds: int) -> Any:
    """JSON Schema's "integer", as the published schema says: 2 and 2.0, not 2.5, true or "2".
    `bounds` (ge, le) are checked after the conversion and published as minimum/maximum."""
    return Annotated[
        Annotated[StrictInt, Field(**bounds)],  # type: ignore[call-overload]  # ge/le only
        BeforeValidator(_integral_float_to_int),
    ]


JsonInt = json_int()
TokenIds = list[JsonInt]
Stop = StrictStr | list[StrictStr]


_LONE_SURROGATE = re.compile(
    "[\ud800-\udfff]"
)  # a valid pair is one code point once JSON is parsed


def _fixed(text: str) -> str:
    if text.isascii() or not _LONE_SURROGATE.search(text):  # isascii is O(1) in CPython
        return text
    return _LONE_SURROGATE.sub("\ufffd", text)


def _copy(container: dict[Any, Any] | list[Any]) -> dict[Any, Any] | list[Any]:
    if isinstance(container, dict):
        return {_fixed(k) if isinstance(k, str) else k: v for k, v in container.items()}
    return list(container)


def replace_lone_surrogates(value: Any) -> Any:
    """`value` (parsed JSON) with every lone surrogate in its strings and keys replaced by U+FFFD.

    Containers are copied, not changed. The walk keeps its own stack instead of recursing, so no
    nesting exhausts Python's (the body's depth is also bounded: `server.json_depth`)."""
    if isinstance(value, str):
        return _fixed(value)
    if not isinstance(value, (dict, list)):
        return value
    root = _copy(value)
    stack = [root]  # copies whose items are still to fix
    while stack:
        container = stack.pop()
        for key, item in container.items() if isinstance(container, dict) else enumerate(container):
            if isinstance(item, str):
                if not item.isascii():
                    container[key] = _fixed(item)
            elif isinstance(item, (dict, list)):
                if isinstance(item, list) and item and isinstance(item[0], (int, float)):
                    continue  # token ids: no strings to fix (or a type error)
                container[key] = item = _copy(item)
                stack.append(item)
    return root


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _replace_lone_surrogates(cls, data: Any) -> Any:
        return replace_lone_surrogates(data)


class StreamOptions(_Request):
    include_usage: StrictBool | None = False


class JSONSchemaSpec(_Request):
    """`response_format.json_schema` (OpenAI's shape). The output always follows `schema`,
    whatever `strict` says (decoding is constrained); no `schema` means any JSON value."""

    name: StrictStr = Field(max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJSONObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


_RESPONSE_FORMAT_TAGS = {
    "text": "ResponseFormatText",
    "json_object": "ResponseFormatJSONObject",
    "json_schema": "ResponseFormatJSONSchema",
}


def _response_format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _RESPONSE_FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


# Tagged by class name (not by `type`) so that an error's location reads `response_format.json_schema`.
ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("ResponseFormatText")]
    | Annotated[ResponseFormatJSONObject, Tag("ResponseFormatJSONObject")]
    | Annotated[ResponseFormatJSONSchema, Tag("ResponseFormatJSONSchema")],
    Discriminator(
        _response_format_tag,
        custom_error_type="invalid_response_format",
        custom_error_message="type must be one of 'text', 'json_object', 'json_schema'",
    ),
]


# Checked in server.validation (a 400 naming logit_bias); the schema says the same for clients.
LogitBias = Annotated[
    dict[str, float],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "token id (a decimal string, below the model's vocabulary size) -> bias added to its logit",
        }
    ),
]


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's and vLLM's extras)."""

    model: StrictStr | None = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    n: json_int(ge=1, le=MAX_N) | None = None
    stop: Stop | None = None
    seed: JsonInt | None = None
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    # Extras (vLLM names).
    top_k: json_int(ge=-1) | None = None
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    min_tokens: json_int(ge=0) | None = None
    ignore_eos: StrictBool | None = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: StrictBool | None = True
    speculative: StrictBool | None = Field(
        None,
        description="false: this request never uses the server's speculative decoding (docs/speculative.md).",
    )
    use_beam_search: StrictBool | None = Field(
        False,
        description="Beam search with n beams; the n best hypotheses are the choices (docs/beam_search.md).",
    )
    length_penalty: StrictFloat | None = Field(
        None,
        ge=-10.0,
        le=10.0,
        description="Beam search: a hypothesis scores summed logprob / length ** length_penalty (default 1).",
    )
    early_stopping: StrictBool | Literal["never"] | None = Field(
        None, description="Beam search: transformers' early_stopping (default false)."
    )
    priority: JsonInt | None = Field(
        None,
        description="Scheduling priority (vLLM's): only 0 is accepted, the server schedules first come, "
        "first served.",
    )
    cache_salt: Annotated[
        Annotated[StrictStr, Field(min_length=1)] | None, BeforeValidator(check_cache_salt)
    ] = Field(
        None,
        description="Only requests with the same salt share cached prompt KV (and its faster first token); "
        "use a random, secret value per tenant, e.g. 256 bits in base64 (docs/security.md).",
    )
    # vLLM's structured-output extras (at most one of these and a non-text response_format). Left out
    # of the OpenAPI document: OpenAI clients do not send them, and a fuzzer that sets several at once
    # only ever gets the at-most-one 400 (docs/structured_outputs.md documents them).
    guided_json: SkipJsonSchema[dict[str, Any] | StrictStr | None] = None
    guided_regex: SkipJsonSchema[StrictStr | None] = None
    guided_choice: SkipJsonSchema[list[StrictStr] | None] = None
    guided_grammar: SkipJsonSchema[StrictStr | None] = None
    structured_outputs: SkipJsonSchema[dict[str, Any] | None] = None


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: json_int(ge=0) | None = 16
    logprobs: json_int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: json_int(ge=1, le=MAX_N) | None = None
    decoder_prompt: StrictStr | TokenIds | None = Field(
        None,
        description="Encoder-decoder models: the decoder's first tokens, which the output continues (every "
        "prompt gets the same). Text goes after the decoder start token, tokenized without special tokens; "
        "token ids are taken as they are and must begin with the start token (docs/encoder_decoder.md).",
    )


class TextContentPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One chat message; extra keys (`tool_calls`, `tool_call_id`, ...) reach the chat template as-is."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[TextContentPart | dict[str, Any]] | None = None
    name: StrictStr | None = None


_FUNCTION_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9_.\-]{1,64}$"}  # tool_parsers._NAME
_TOOLS_SCHEMA = {
    "anyOf": [
        {"type": "null"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": _FUNCTION_NAME,
                            "description": {"type": "string"},
                            "parameters": {"type": "object"},
                        },
                    },
                },
            },
        },
    ]
}
_TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"type": "null"},
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": _FUNCTION_NAME},
                },
            },
        },
    ]
}


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: json_int(ge=1) | None = None
    max_completion_tokens: json_int(ge=1) | None = None
    logprobs: StrictBool | None = False
    top_logprobs: json_int(ge=0, le=MAX_LOGPROBS) | None = None
    # validated in server/tool_parsers.py (400s naming the bad field); typed here for the published schema
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(_TOOLS_SCHEMA)] = None
    tool_choice: Annotated[Any, WithJsonSchema(_TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = Field(
        None,
        description="Passed to the chat template as `reasoning_effort` (templates that read it).",
    )


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: TokenIds


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning (up to its end marker)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking (--reasoning-parser), apart from the answer
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = (
        None  # vLLM's: the stop string or stop token id that ended the choice
    )


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """`GET /tokenizer_info`: the tokenizer's configuration (as vLLM serves it: `tokenizer_config.json`'s
    fields, file paths left out) plus what lm-eval's remote tokenizer reads."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    model_max_length: int
    chat_template: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body (OpenAI's shape)."""

    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error body on /v1/messages (Anthropic's shape)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo

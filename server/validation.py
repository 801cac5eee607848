"""Validate at the edge: a parsed HTTP request becomes a `ValidatedRequest` the engine can run.

Everything that can be wrong with a request is found here (ranges, unsupported
fields, prompt tokenization, prompt + max_tokens against the context length,
`SamplingParams`' own checks) and reported as a 400 before the engine sees it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.engine import SamplingParams, StructuredOutputs
from kvserve.engine.beam_search import BeamSearchParams
from kvserve.engine.generation_config import GenerationConfig
from kvserve.engine.input_processor import PromptTooLongError, check_prompt_chars
from kvserve.engine.lora_request import LoRARequest
from kvserve.engine.sampling_params import MAX_ABS_LOGIT_BIAS
from kvserve.engine.structured_output.limits import GrammarLimits, check_limits
from kvserve.server.chat import render_chat
from kvserve.server.errors import APIError, bad_request
from kvserve.server.json_depth import check_json_depth
from kvserve.server.protocol import (
    MAX_SEQS_PER_REQUEST,
    MAX_STOP,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    SamplingFields,
)
from kvserve.server.reasoning import ReasoningParser
from kvserve.server.tool_parsers import TOOL_PARSERS, ToolPlan, plan_tools

_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
    "logit_bias",
    "speculative",
)
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # vLLM's extras -> StructuredOutputs fields
_TOKEN_ID_KEY = re.compile(r"[0-9]+")


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    """One engine request's prompt: its token ids (what the engine runs) and its text (for echo)."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """A request that passed every check; `prompts[i]` becomes engine request `f"{request_id}-{i}"`."""

    kind: Literal["completion", "chat"]
    request_id: str
    model_name: str
    prompts: list[EnginePrompt]
    params: SamplingParams
    num_choices: int  # n: choices per prompt
    num_logprobs: int | None  # top-logprobs to report per token (None: no logprobs)
    is_echo: bool
    is_scoring_only: bool  # echo with max_tokens=0: report the prompt only, drop generated tokens
    is_stream: bool
    include_usage: bool
    structured_outputs_param: str | None = None  # the field the output constraint came from
    tools: ToolPlan | None = None  # chat with tools: how to read tool calls from the output
    cache_salt: str | None = None  # only requests with the same salt share cached KV blocks
    beam: BeamSearchParams | None = None  # use_beam_search: the search's settings (n beams)
    # an encoder-decoder's decoder prefix for every prompt, start token first (None: the start token alone)
    decoder_prompt_token_ids: list[int] | None = None
    reasoning: ReasoningParser | None = None  # chat: split the thinking from the answer
    reasoning_state: Literal["open", "reasoning"] = (
        "open"  # where the output starts (ReasoningParser)
    )
    priority: int = 0  # --scheduling-policy priority: lower runs first
    lora_request: LoRARequest | None = None  # `model` named a LoRA adapter (server/lora.py)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What validation needs to know about the served model, and the server's limits (the
    options' values: their defaults are declared on `ServerConfig` and `EngineArgs` only)."""

    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    chat_template: str | None
    max_tokens_zero_ok: bool  # whether SamplingParams accepts max_tokens=0 (prompt scoring)
    kv_capacity_tokens: int  # a request longer than the whole KV cache can never run
    max_chat_messages: int  # --max-chat-messages
    max_tools: int  # --max-tools
    grammar_limits: GrammarLimits  # --max-schema-properties etc.
    scheduling_policy: str  # --scheduling-policy: whether `priority` can be honoured
    max_chars_per_token: int | None = (
        None  # refuse longer prompts before tokenizing (None: no bound)
    )
    tool_call_parser: str | None = (
        None  # --tool-call-parser (None: tool_choice "auto" gives plain text)
    )
    # an encoder-decoder model: the prompt is the source, bounded on its own; the decoder (its start
    # token, or `decoder_prompt`, plus max_tokens) is bounded separately
    is_encoder_decoder: bool = False
    decoder_start_token_id: int | None = None  # encoder-decoder models: the decoder's first token
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser (None: no split)
    # --generation-config: the checkpoint's defaults for fields a request leaves out
    generation_config: GenerationConfig = GenerationConfig()
    # LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter): the one dict server/lora.py edits
    lora_adapters: dict[str, LoRARequest] = field(default_factory=dict)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(name: str | None, limits: ModelLimits) -> str:
    """The served name to report (a LoRA adapter's own); 404 unless `name` is one of the served
    names, a loaded adapter, or omitted."""
    if name is None or name in limits.served_model_names:
        return limits.served_model_names[0]
    if name in limits.lora_adapters:
        return name
    served = [*limits.served_model_names, *limits.lora_adapters]
    raise APIError(
        404,
        f"The model `{name}` does not exist. Served: {', '.join(served)}",
        param="model",
        code="model_not_found",
    )


def _check_common(req: SamplingFields, limits: ModelLimits) -> None:
    if req.stream_options is not None and not req.stream:  # OpenAI refuses it too
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request(
            f"stop accepts at most {MAX_STOP} sequences, got {len(stops)}", param="stop"
        )
    if any(s == "" for s in stops):
        raise bad_request("stop sequences must not be empty", param="stop")
    for token_id in req.stop_token_ids or []:
        if not 0 <= token_id < limits.vocab_size:
            raise bad_request(
                f"stop_token_ids: {token_id} is outside the vocabulary [0, {limits.vocab_size})",
                param="stop_token_ids",
            )
    check_priority(req.priority, limits)


def check_priority(priority: int | None, limits: ModelLimits) -> None:
    """Under `--scheduling-policy fcfs` a priority other than 0 cannot be honoured: a 400, not ignored."""
    if priority and limits.scheduling_policy == "fcfs":
        raise bad_request(
            f"priority {priority} cannot be honoured: the server schedules first come, first served "
            "(--scheduling-policy fcfs); send 0, or start it with --scheduling-policy priority",
            param="priority",
        )


def logit_bias(req: SamplingFields, limits: ModelLimits) -> dict[int, float] | None:
    """OpenAI's `{"token id": bias}` as `{int: float}`; 400 for a key that is no token id of the model or
    a bias outside [-100, 100]."""
    if not req.logit_bias:
        return None
    result = {}
    for key, bias in req.logit_bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_request(
                f"logit_bias keys must be token ids (decimal integers), got {key!r}",
                param="logit_bias",
            )
        if len(key) > 9 or int(key) >= limits.vocab_size:
            raise bad_request(
                f"logit_bias: token id {key} is outside the vocabulary [0, {limits.vocab_size})",
                param="logit_bias",
            )
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:  # NaN fails too
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}",
                param="logit_bias",
            )
        result[int(key)] = bias
    return result


def structured_outputs(
    req: SamplingFields, limits: ModelLimits
) -> tuple[StructuredOutputs | None, str | None]:
    """The output constraint and the field it came from: `response_format` (json_object or
    json_schema) or one of vLLM's extras (`guided_*`, `structured_outputs`); 400 if more than one
    or if it is over a grammar limit."""
    given: list[tuple[str, dict[str, Any]]] = []
    if isinstance(req.response_format, ResponseFormatJSONObject):
        given.append(("response_format", {"json_object": True}))
    elif isinstance(req.response_format, ResponseFormatJSONSchema):
        schema = req.response_format.json_schema.schema_
        given.append(("response_format", {"json": {} if schema is None else schema}))
    given += [
        (name, {kind: getattr(req, name)})
        for name, kind in _GUIDED_FIELDS.items()
        if getattr(req, name) is not None
    ]
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(
            f"give at most one output constraint (response_format json_object/json_schema, "
            f"{', '.join(_GUIDED_FIELDS)}, structured_outputs); got {[n for n, _ in given]}",
            param=given[1][0],
        )
    param, spec = given[0]
    if isinstance(
        spec.get("json"), str
    ):  # a schema sent as a string: the body's depth check did not see into it
        check_json_depth(spec["json"], param)
    try:
        constraint = StructuredOutputs(**spec)
        check_limits(constraint, limits.grammar_limits)
        return constraint, param
    except TypeError:  # an unknown key in `structured_outputs`
        raise bad_request(
            f"structured_outputs accepts json, json_object, regex, choice, grammar and "
            f"any_whitespace; got {sorted(spec)}",
            param=param,
        ) from None
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None


def _check_token_ids(token_ids: list[int], limits: ModelLimits, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < limits.vocab_size:
            raise bad_request(
                f"{param}: token id {token_id} is outside the vocabulary [0, {limits.vocab_size})",
                param=param,
            )


def _check_prompt_chars(text: str, max_tokens: int, limits: ModelLimits, param: str) -> None:
    """The context_length_exceeded 400 for a prompt too long to fit, before tokenizing it."""
    try:
        check_prompt_chars(len(text), max_tokens, limits.max_model_len, limits.max_chars_per_token)
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None


def input_size(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Roughly how many characters validating `req` tokenizes or renders (small ones run inline)."""
    if isinstance(req, ChatCompletionRequest):
        return messages_size(req.messages)
    prompts = (
        [req.prompt]
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))
        else req.prompt
    )
    if req.decoder_prompt is not None:
        prompts = [*prompts, req.decoder_prompt]
    return sum(
        len(p) * (1 if isinstance(p, str) else 4) for p in prompts
    )  # token ids: decoded for echo


def messages_size(messages: list[Any]) -> int:
    """Characters of content, plus 64 per message and content part for the template's work."""
    return sum(
        64
        + (
            sum(64 + len(getattr(part, "text", "")) for part in m.content)
            if isinstance(m.content, list)
            else len(m.content or "")
        )
        for m in messages
    )


def check_num_messages(messages: list[Any], limits: ModelLimits) -> None:
    """`--max-chat-messages` bounds messages and, separately, their content parts."""
    num_parts = sum(len(m.content) for m in messages if isinstance(m.content, list))
    for count, what in ((len(messages), "messages"), (num_parts, "content parts")):
        if count > limits.max_chat_messages:
            raise bad_request(
                f"this request has {count} {what}; the server accepts at most "
                f"{limits.max_chat_messages} (--max-chat-messages)",
                param="messages",
            )


def _check_length(num_prompt_tokens: int, max_tokens: int, limits: ModelLimits, param: str) -> None:
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty", param=param)
    if num_prompt_tokens + max_tokens > limits.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or completion.",
            param=param,
            code="context_length_exceeded",
        )


def decoder_prompt(
    req: CompletionRequest, limits: ModelLimits, tokenizer: Any, max_tokens: int
) -> list[int] | None:
    """`decoder_prompt` as the decoder's first token ids (None when not given): text is tokenized
    without special tokens and put after the decoder start token; token ids are taken as they are
    and must begin with it (as `decoder_prompt_token_ids` offline). 400 naming the field on a
    decoder-only model, for an id outside the vocabulary, or without the start token first."""
    value, param = req.decoder_prompt, "decoder_prompt"
    if value is None:
        return None
    start = limits.decoder_start_token_id
    if start is None:
        raise bad_request("decoder_prompt applies only to encoder-decoder models", param=param)
    if isinstance(value, str):
        _check_prompt_chars(value, max_tokens + 1, limits, param)  # (+ 1: the start token)
        return [start, *tokenizer.encode(value, add_special_tokens=False)]
    _check_token_ids(value, limits, param)
    if not value or value[0] != start:
        raise bad_request(
            f"decoder_prompt token ids must begin with the decoder start token {start}, got "
            f"{value[:8]}",
            param=param,
        )
    return list(value)


def _check_decoder_length(
    num_source_tokens: int, decoder_prompt: list[int] | None, max_tokens: int, limits: ModelLimits
) -> None:
    """An encoder-decoder request: its decoder prompt (the start token alone by default) and
    max_tokens within the context, and with the source within the KV cache, as the engine checks
    them; here, so that beam search (one-token steps) is refused before it starts."""
    num_decoder = 1 if decoder_prompt is None else len(decoder_prompt)
    param = "max_tokens" if decoder_prompt is None else "decoder_prompt"
    if num_decoder + max_tokens > limits.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{num_decoder + max_tokens} decoder tokens ({num_decoder} in the decoder prompt, the start token "
            f"included, {max_tokens} in the completion). Please reduce the length of the decoder prompt or "
            f"completion.",
            param=param,
            code="context_length_exceeded",
        )
    if num_source_tokens + num_decoder + max_tokens > limits.kv_capacity_tokens:
        raise bad_request(
            f"source ({num_source_tokens} tokens) + decoder prompt ({num_decoder}) + max_tokens "
            f"({max_tokens}) can never fit in the KV cache ({limits.kv_capacity_tokens} tokens)",
            param=param,
        )


# Fields that beam search does not honour; a request that sets one with use_beam_search gets a 400
# naming it rather than a result that silently ignored it. (temperature: only 0 or unset.)
_NOT_WITH_BEAMS = (
    "stream",
    "logprobs",
    "top_logprobs",
    "echo",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "seed",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tools",
)


def beam_params(
    req: SamplingFields, max_tokens: int, defaults: GenerationConfig
) -> BeamSearchParams | None:
    """The request's beam search settings (None without use_beam_search; `length_penalty` and
    `early_stopping` left out: the checkpoint's); 400 for a field beam search cannot honour, or a
    beam setting without use_beam_search."""
    if not req.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(req, name) is not None:
                raise bad_request(f"{name} applies only with use_beam_search", param=name)
        return None
    for name in _NOT_WITH_BEAMS:
        value = getattr(req, name, None)
        if (
            name in req.model_fields_set
            and value not in (None, False, [], {})
            and not (name == "response_format" and value.type == "text")
        ):
            raise bad_request(f"{name} is not supported with use_beam_search", param=name)
    if req.temperature:
        raise bad_request(
            "use_beam_search ranks hypotheses by the model's own log-probabilities: temperature "
            "must be 0 or unset",
            param="temperature",
        )
    length_penalty = (
        req.length_penalty if req.length_penalty is not None else defaults.length_penalty
    )
    early_stopping = (
        req.early_stopping if req.early_stopping is not None else defaults.early_stopping
    )
    try:
        return BeamSearchParams(
            beam_width=req.n or 1,
            max_tokens=max_tokens,
            length_penalty=1.0 if length_penalty is None else length_penalty,
            early_stopping=bool(early_stopping) if early_stopping != "never" else "never",
            ignore_eos=bool(req.ignore_eos),
        )
    except ValueError as exc:
        message = str(exc).replace("beam_width", "n (the beam width)")
        raise bad_request(
            message, param="n" if "beam_width" in str(exc) else param_for_message(message)
        ) from None


def _sampling_params(
    req: SamplingFields, param_names: dict[str, str], defaults: GenerationConfig, **kwargs: Any
) -> SamplingParams:
    """Build SamplingParams from the request's set fields, then the checkpoint's defaults
    (--generation-config) for the sampling fields it left out; its ValueError becomes a 400 naming the field."""
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "speculative",
    ):
        value = getattr(req, name)
        if value is not None and kwargs.get(name) is None:  # a caller's value wins over the default
            kwargs[name] = value
    for name, value in defaults.sampling_defaults.items():
        if name != "max_tokens" and kwargs.get(name) is None:
            kwargs[name] = int(value) if name == "top_k" else value
    kwargs["n"] = req.n or 1
    if req.stop:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param=param_for_message(str(exc), param_names)) from None


def param_for_message(message: str, param_names: dict[str, str] | None = None) -> str | None:
    """Best-effort: the request field an engine error message is about (it names the field)."""
    found = [
        (match.start(), name)
        for name in _SAMPLING_FIELDS
        if (match := re.search(rf"\b{name}\b", message)) is not None
    ]
    if not found:
        return None
    name = min(found)[1]  # the engine's messages start with the field's name
    return (param_names or {}).get(name, name)


def validate_completion(
    req: CompletionRequest, limits: ModelLimits, tokenizer: Any
) -> ValidatedRequest:
    """Check a /v1/completions request and tokenize its prompt(s)."""
    model_name = check_model(req.model, limits)
    _check_common(req, limits)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of is not supported (it must equal n)", param="best_of")
    is_echo = bool(req.echo)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not is_echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens"
        )
    is_scoring_only = max_tokens == 0
    engine_max_tokens = 1 if is_scoring_only and not limits.max_tokens_zero_ok else max_tokens

    # (an encoder-decoder's source and output each have the whole context: the source is checked alone)
    output_tokens = 0 if limits.is_encoder_decoder else engine_max_tokens
    prompts = _completion_prompts(req.prompt, req.n or 1, limits, tokenizer, output_tokens)
    for prompt in prompts:
        _check_length(len(prompt.token_ids), output_tokens, limits, "prompt")
    decoder_prompt_token_ids = decoder_prompt(req, limits, tokenizer, engine_max_tokens)
    if limits.is_encoder_decoder:
        for prompt in prompts:
            _check_decoder_length(
                len(prompt.token_ids), decoder_prompt_token_ids, engine_max_tokens, limits
            )
    constraint, constraint_param = structured_outputs(req, limits)
    params = _sampling_params(
        req,
        {"prompt_logprobs": "logprobs"},
        limits.generation_config,
        max_tokens=engine_max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if is_echo and req.logprobs is not None else None,
        logit_bias=logit_bias(req, limits),
        structured_outputs=constraint,
    )
    return ValidatedRequest(
        kind="completion",
        request_id=new_request_id("cmpl"),
        model_name=model_name,
        prompts=prompts,
        params=params,
        num_choices=req.n or 1,
        num_logprobs=req.logprobs,
        is_echo=is_echo,
        is_scoring_only=is_scoring_only,
        is_stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        structured_outputs_param=constraint_param,
        cache_salt=req.cache_salt,
        beam=beam_params(req, max_tokens, limits.generation_config),
        decoder_prompt_token_ids=decoder_prompt_token_ids,
        priority=req.priority or 0,
    )


def tenant_cache_salt(tenant: str, cache_salt: str | None) -> str:
    """The salt of a request sent with the API key whose tag is `tenant` (--cache-salt-per-api-key):
    every tenant's salts start with its fixed-length tag, so no client salt reaches another's."""
    return tenant if cache_salt is None else f"{tenant}:{cache_salt}"


def _completion_prompts(
    prompt: Any, n: int, limits: ModelLimits, tokenizer: Any, max_tokens: int
) -> list[EnginePrompt]:
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be an empty list", param="prompt")
    if len(items) * n > MAX_SEQS_PER_REQUEST:
        raise bad_request(
            f"{len(items)} prompts x n={n} is more than {MAX_SEQS_PER_REQUEST} sequences "
            "in one request",
            param="prompt",
        )
    prompts = []
    for item in items:
        if isinstance(item, str):
            if item == "":
                raise bad_request("the prompt is empty", param="prompt")
            _check_prompt_chars(item, max_tokens, limits, "prompt")
            prompts.append(EnginePrompt(list(tokenizer.encode(item)), item))
        else:
            _check_token_ids(item, limits, "prompt")
            prompts.append(EnginePrompt(list(item), tokenizer.decode(item) if item else ""))
    return prompts


def validate_chat(
    req: ChatCompletionRequest, limits: ModelLimits, tokenizer: Any
) -> ValidatedRequest:
    """Check a /v1/chat/completions request, render its messages and tokenize them."""
    model_name = check_model(req.model, limits)
    _check_common(req, limits)
    if req.tools is not None and len(req.tools) > limits.max_tools:
        raise bad_request(
            f"this request has {len(req.tools)} tools; at most {limits.max_tools} are allowed "
            f"(--max-tools {limits.max_tools})",
            param="tools",
        )
    tools, tool_plan, tool_schema = plan_tools(
        req.tools, req.tool_choice, req.parallel_tool_calls, limits.tool_call_parser
    )
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")

    check_num_messages(req.messages, limits)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    text = render_chat(
        tokenizer,
        limits.chat_template,
        req.messages,
        bool(req.add_generation_prompt),
        template_kwargs,
        tools=tools,
    )
    max_tokens_param = (
        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    )
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    _check_prompt_chars(text, 1 if max_tokens is None else max_tokens, limits, "messages")
    token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    if max_tokens is None:  # the rest of the context (or of the KV cache, if that is smaller)
        if len(token_ids) >= limits.max_model_len:
            _check_length(len(token_ids), 1, limits, "messages")
        max_tokens = max(min(limits.max_model_len, limits.kv_capacity_tokens) - len(token_ids), 1)
    _check_length(len(token_ids), max_tokens, limits, "messages")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    constraint, constraint_param = structured_outputs(req, limits)
    skip_special_tokens = None
    if tool_schema is not None:  # tool_choice "required" or a named function: enforced by a grammar
        if constraint is not None:
            raise bad_request(
                f"tool_choice {req.tool_choice!r} cannot be combined with {constraint_param}",
                param="tool_choice",
            )
        try:
            constraint, constraint_param = StructuredOutputs(json=tool_schema), "tools"
            check_limits(constraint, limits.grammar_limits)
        except (
            ValueError
        ) as exc:  # a keyword the grammar cannot enforce, or the tools' schema is too big
            raise bad_request(f"tools: {exc}", param="tools") from None
    elif (
        tool_plan is not None
        and tool_plan.parser
        and TOOL_PARSERS[tool_plan.parser].needs_special_tokens
        and "skip_special_tokens" not in req.model_fields_set
    ):
        skip_special_tokens = False  # the call marker is a special token
    params = _sampling_params(
        req,
        {"max_tokens": max_tokens_param, "logprobs": "top_logprobs"},
        limits.generation_config,
        skip_special_tokens=skip_special_tokens,
        max_tokens=max_tokens,
        logprobs=num_logprobs,
        logit_bias=logit_bias(req, limits),
        structured_outputs=constraint,
    )
    reasoning = None if req.use_beam_search else limits.reasoning_parser
    reasoning_state = (
        "open"
        if reasoning is None
        else reasoning.initial_state(text, is_constrained=params.structured_outputs is not None)
    )
    return ValidatedRequest(
        kind="chat",
        request_id=new_request_id("chatcmpl"),
        model_name=model_name,
        prompts=[EnginePrompt(token_ids, text)],
        params=params,
        num_choices=req.n or 1,
        num_logprobs=num_logprobs,
        is_echo=False,
        is_scoring_only=False,
        is_stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        structured_outputs_param=constraint_param,
        tools=tool_plan,
        cache_salt=req.cache_salt,
        beam=beam_params(req, max_tokens, limits.generation_config),
        reasoning=reasoning,
        reasoning_state=reasoning_state,
        priority=req.priority or 0,
    )


def max_tokens_zero_supported() -> bool:
    """Whether the engine's SamplingParams accepts max_tokens=0 (scoring a prompt without generating)."""
    try:
        SamplingParams(max_tokens=0)
    except (ValueError, TypeError):
        return False
    return True

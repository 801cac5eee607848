"""Server configuration: one frozen settings object, read from CLI flags and `KVSERVE_*` env vars.

Every field is a flag (`--max-num-seqs`) and an environment variable
(`KVSERVE_MAX_NUM_SEQS`); a flag given on the command line wins over the
environment, which wins over the default. List fields (`served_model_name`,
`cors_origin`, `api_key`) take comma-separated values in the environment. Empty variables are ignored.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ByteSize, Field, TypeAdapter, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.grammar_limits import GrammarLimits

ENV_PREFIX = "KVSERVE_"
_LIMITS = GrammarLimits()  # the engine's defaults
_GRAMMAR_LIMIT_FIELDS = ("max_schema_properties", "max_schema_depth", "max_schema_enum_values",
                         "max_schema_string_chars", "max_regex_chars", "max_grammar_chars", "max_choices",
                         "max_choice_chars")

def _number_or_unit(value: Any) -> Any:
    """Pydantic's `ByteSize` reads `4GiB` and `512MB`; plain numbers (`1e9`, `1048576`) are read here."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"invalid size {value!r}")
        return int(value)
    return value


def _positive(size: int) -> int:
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    return int(size)


# A byte count: `4GiB`, `512MB`, `1.5 KiB`, `1e9`, `1048576` (KB, MB, ... and K, M, ... are powers of 1000).
Size = Annotated[ByteSize, BeforeValidator(_number_or_unit), AfterValidator(_positive)]
_SIZE_ADAPTER: TypeAdapter[int] = TypeAdapter(Size)


def parse_size(value: str | int | float) -> int:
    """Parse a byte count such as `4GiB`, `512MB`, `1e9` or `1048576`; ValueError if it is not one."""
    return _SIZE_ADAPTER.validate_python(value)


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class ServerConfig(BaseSettings):
    """Everything `kvserve serve` can be told. Engine fields are passed through to `EngineArgs`."""

    # An empty variable (e.g. `KVSERVE_MAX_QUEUE=` from a compose file) counts as unset.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid", env_ignore_empty=True)

    # --- model and engine (passed to engine.EngineArgs) ---
    model: str | None = Field(
        None, description="Checkpoint directory or Hub id; unset serves the embedded default model.")
    tokenizer: str | None = Field(None, description="Tokenizer directory or Hub id (default: the model's).")
    served_model_name: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Name(s) clients must send as `model` (default: the --model value, or kvserve-default). "
        "The first one is used in responses.",
    )
    dtype: str = Field("auto", description="Weight/activation dtype: auto, float32, float16, bfloat16.")
    device: str = Field("auto", description="Device: auto, cpu, cuda, cuda:N.")
    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(256, gt=0, description="Most sequences in one running batch.")
    max_num_batched_tokens: int = Field(2048, gt=0, description="Token budget of one engine step.")
    kv_cache_memory: Size | None = Field(None, description="Bytes for the KV cache; accepts 4GiB, 512MB, 1e9.")
    num_kv_blocks: int | None = Field(
        None, gt=0, description="Exact number of KV blocks (overrides --kv-cache-memory).")
    max_model_len: int | None = Field(None, gt=0, description="Context length limit (default: the model's).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    seed: int = Field(0, description="Engine random seed.")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="Attention kernels: auto (cpu on CPU, triton on CUDA), torch (portable reference), "
        "cpu, triton.")
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly (no CUDA graphs).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA: share of the GPU's memory kvserve may use (weights, activations, KV).")
    tensor_parallel_size: int = Field(
        1, gt=0, description="Split the model over N devices (N GPUs; on the CPU, N processes): docs/scaling.md.")

    # --- HTTP server ---
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 picks a free one).")
    max_queue: Annotated[int, Field(ge=0)] | Literal["auto", "off"] = Field(
        "auto", description="Refuse new requests with 503 when more than this many sequences would wait; auto: "
        "twice as many as can run at once (the smaller of --max-num-seqs and the KV blocks); off: no limit.")
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Require `Authorization: Bearer KEY` on API routes, KEY being any of "
        "these keys.")
    cache_salt_per_api_key: bool = Field(
        False, description="Make each API key a tenant of its own: requests share cached KV blocks (and their "
        "time to first token) only with requests sent with the same key (docs/security.md). Needs --api-key.")
    metrics_require_api_key: bool = Field(
        False, description="Require an API key on /metrics too (Prometheus then sends one: docs/server.md). "
        "Needs --api-key.")
    cors_origin: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Allowed CORS origin(s); `*` allows any."
    )
    chat_template: str | None = Field(
        None, description="Chat template file or inline Jinja string (overrides the model's).")
    tool_call_parser: Literal["none", "hermes", "llama3_json", "mistral"] = Field(
        "none", description="How tool calls are read from output under tool_choice auto: hermes (Hermes/Qwen2.5 "
        "<tool_call>), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]); none: auto gives plain text "
        "(required and named choices are enforced by a grammar either way).")
    max_body_bytes: Size = Field(4 * 1024**2, description="Largest accepted request body; accepts 4MiB etc.")
    max_chat_messages: int = Field(
        4096, gt=0, description="Most messages (and most content parts) in one chat request; more is a 400.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")

    # --- tools and structured outputs (docs/structured_outputs.md, "Limits") ---
    max_tools: int = Field(128, gt=0, description="Most tools in one chat request (OpenAI: 128); more is a 400.")
    grammar_compile_timeout: float = Field(
        20.0, gt=0, description="Seconds a request may wait for its grammar (queue and compile); then it fails "
        "with a 400 (or an error event).")
    max_grammar_queue: int | None = Field(
        64, gt=0, description="Most distinct grammars queued or compiling at once; a request needing one more "
        "gets 503 (unset: no limit).")
    grammar_compile_threads: int | None = Field(
        None, gt=0, description="Grammar compile threads, at a low CPU priority (nice 10; unset: one per two "
        "cores, at most 2).")
    max_schema_properties: int = Field(
        _LIMITS.max_schema_properties, gt=0, description="Most object properties in one JSON schema (OpenAI: 5000).")
    max_schema_depth: int = Field(
        _LIMITS.max_schema_depth, gt=0, description="Deepest nesting of a JSON schema, every subschema counting one "
        "level (OpenAI: 10 object levels).")
    max_schema_enum_values: int = Field(
        _LIMITS.max_schema_enum_values, gt=0, description="Most enum values in one JSON schema (OpenAI: 1000).")
    max_schema_string_chars: int = Field(
        _LIMITS.max_schema_string_chars, gt=0, description="Most characters of property names, enum and const "
        "values and patterns in one JSON schema (OpenAI: 120000).")
    max_regex_chars: int = Field(_LIMITS.max_regex_chars, gt=0, description="Longest guided_regex.")
    max_grammar_chars: int = Field(_LIMITS.max_grammar_chars, gt=0, description="Longest guided_grammar (EBNF).")
    max_choices: int = Field(_LIMITS.max_choices, gt=0, description="Most strings in a guided_choice.")
    max_choice_chars: int = Field(
        _LIMITS.max_choice_chars, gt=0, description="Most characters in a guided_choice, all strings together.")
    stats_log_interval: float = Field(
        5.0, ge=0, description="Seconds between throughput log lines while busy (0: off).")

    # --- slow and hostile clients ---
    stream_idle_timeout: float = Field(
        60.0, ge=0, description="Close a connection (and abort its request, freeing its seat and KV blocks) when "
        "the client has read nothing for this many seconds while the response waits to be written (0: off).")
    header_timeout: float = Field(
        10.0, ge=0, description="Close a connection that has not sent complete request headers after this many "
        "seconds (0: off).")
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="Close an idle kept-alive connection after this many seconds.")
    max_connections: int | None = Field(
        None, gt=0, description="Most open client connections: beyond it the oldest idle one (or, if none is "
        "idle, the new one) is closed (unset: the open-file limit minus 128).")

    # --- failures and shutdown ---
    shutdown_timeout: float = Field(
        30.0, ge=0, description="On SIGTERM/SIGINT, seconds in-flight requests may take to finish (new ones "
        "get 503); then open streams get an error event and the server exits.")
    max_consecutive_step_failures: int = Field(
        3, gt=0, description="Failed engine steps in a row after which the engine counts as dead "
        "(one failed step fails only its requests).")
    keep_alive_on_engine_death: bool = Field(
        False, description="Keep serving (/health 503, requests 503) after the engine died instead of exiting "
        "with code 1; for debugging.")

    @field_validator("served_model_name", "cors_origin", "api_key", mode="before")
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [item for part in value for item in _split_csv(part)]
        return _split_csv(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("model", "tokenizer", "chat_template", "kv_cache_memory", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _needs_api_key(self) -> ServerConfig:
        for name in ("cache_salt_per_api_key", "metrics_require_api_key"):
            if getattr(self, name) and not self.api_key:
                raise ValueError(f"--{name.replace('_', '-')} needs at least one --api-key")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `engine.EngineArgs`."""
        names = ("model", "tokenizer", "dtype", "device", "block_size", "max_num_seqs", "max_num_batched_tokens",
                 "kv_cache_memory", "num_kv_blocks", "enable_prefix_caching", "seed", "max_model_len",
                 "attention_backend", "enforce_eager", "gpu_memory_utilization", "tensor_parallel_size")
        grammar = {"grammar_compile_timeout_s": self.grammar_compile_timeout,
                   "max_grammar_queue": self.max_grammar_queue, "grammar_compile_threads": self.grammar_compile_threads,
                   **{name: getattr(self, name) for name in _GRAMMAR_LIMIT_FIELDS}}
        return {**{name: getattr(self, name) for name in names}, **grammar}

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(**{name: getattr(self, name) for name in _GRAMMAR_LIMIT_FIELDS})

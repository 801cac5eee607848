"""Server configuration: one frozen settings object, read from CLI flags and `KVSERVE_*` env vars.

Every field is a flag (`--max-num-seqs`) and an environment variable
(`KVSERVE_MAX_NUM_SEQS`); a flag given on the command line wins over the
environment, which wins over the default. The engine's fields are not written here: they
are generated from `engine.EngineArgs` (its defaults, types, choices and help), and
`EngineArgs`' own checks validate them. List fields (`served_model_name`,
`cors_origin`, `api_key`) take comma-separated values in the environment. Empty variables are ignored.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ByteSize,
    Field,
    TypeAdapter,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvserve.engine.config import EngineArgs, GrammarLimits

ENV_PREFIX = "KVSERVE_"


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


def _settings_field(field: dataclasses.Field[Any], annotation: Any) -> tuple[Any, Any]:
    """(annotation, Field) of one option of an options dataclass, as the server reads it."""
    meta = field.metadata
    optional = type(None) in typing.get_args(annotation)
    if meta.get("choices"):
        annotation = Literal[meta["choices"]] | None if optional else Literal[meta["choices"]]
    elif meta.get("unit") == "bytes":
        annotation = Size | None if optional else Size
    extra = {key: meta[key] for key in ("metavar", "aliases", "unit") if meta.get(key)}
    return annotation, Field(
        meta.get("server_default", field.default),
        description=meta["help"],
        json_schema_extra=extra or None,
    )


class DataclassSettings(BaseSettings):
    """Settings whose fields are generated from an options dataclass (`settings_model`): the
    dataclass keeps the defaults, help and checks, these add flags and environment variables."""

    source: ClassVar[type]

    @model_validator(mode="after")
    def _check_with_source(self) -> DataclassSettings:
        self.to_dataclass()  # its own checks: a ValueError naming the option and the value
        return self

    def to_dataclass(self) -> Any:
        options = self.source(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self.source)}
        )
        if hasattr(options, "validate"):
            options.validate()
        return options


def settings_model(name: str, source: type, env_prefix: str) -> type[DataclassSettings]:
    """A pydantic settings model with one field per field of the options dataclass `source`."""
    hints = typing.get_type_hints(source)
    fields = {f.name: _settings_field(f, hints[f.name]) for f in dataclasses.fields(source)}
    model = create_model(name, __base__=DataclassSettings, **fields)  # type: ignore[call-overload]  # built at run time
    model.source = source
    model.model_config["env_prefix"] = env_prefix
    return model


ENGINE_OPTIONS = tuple(field.name for field in dataclasses.fields(EngineArgs))
_EngineOptions = settings_model("_EngineOptions", EngineArgs, ENV_PREFIX)


class ServerConfig(_EngineOptions):  # type: ignore[valid-type, misc]  # generated from EngineArgs
    """Everything `kvserve serve` can be told: the engine's options (generated from `EngineArgs`,
    passed through by `engine_kwargs`), then the server's own."""

    # An empty variable (e.g. `KVSERVE_MAX_QUEUE=` from a compose file) counts as unset.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", env_ignore_empty=True
    )

    # --- model names ---
    served_model_name: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Name(s) clients must send as `model` (default: the --model value, or kvserve-default). "
        "The first one is used in responses.",
        json_schema_extra={"metavar": "NAME"},
    )

    # --- HTTP server ---
    host: str = Field("127.0.0.1", description="Address to bind (0.0.0.0: every interface).")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 picks a free one).")
    max_queue: Annotated[int, Field(ge=0)] | Literal["auto", "off"] = Field(
        "auto",
        description="Refuse new requests with 503 when more than this many sequences would wait; auto: "
        "twice as many as can run at once (the smaller of --max-num-seqs and the KV blocks); off: no limit.",
    )
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Require `Authorization: Bearer KEY` on API routes, KEY being any of "
        "these keys.",
        json_schema_extra={"metavar": "KEY"},
    )
    cache_salt_per_api_key: bool = Field(
        False,
        description="Make each API key a tenant of its own: requests share cached KV blocks (and their "
        "time to first token) only with requests sent with the same key (docs/security.md). Needs --api-key.",
    )
    metrics_require_api_key: bool = Field(
        False,
        description="Require an API key on /metrics too (Prometheus then sends one: docs/server.md). "
        "Needs --api-key.",
    )
    cors_origin: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Allowed CORS origin(s); `*` allows any.",
        json_schema_extra={"metavar": "ORIGIN"},
    )
    chat_template: str | None = Field(
        None,
        description="Chat template file or inline Jinja string (overrides the model's).",
        json_schema_extra={"metavar": "PATH_OR_STR"},
    )
    tool_call_parser: Literal["none", "hermes", "llama3_json", "mistral"] = Field(
        "none",
        description="How tool calls are read from output under tool_choice auto: hermes (Hermes/Qwen2.5 "
        "`<tool_call>`), llama3_json (Llama 3.x JSON), mistral (`[TOOL_CALLS]`); docs/tools.md; none: auto gives "
        "plain text (required and named choices are enforced by a grammar either way).",
    )
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3"] = Field(
        "auto",
        description="How a thinking model's `<think>...</think>` text is split from its answer into "
        "reasoning_content: deepseek_r1, qwen3; auto: from the chat template where it is unambiguous; none: no split.",
    )
    max_body_bytes: Size = Field(  # type: ignore[assignment]  # pydantic reads the int as a ByteSize
        4 * 1024**2,
        description="Largest accepted request body (413 beyond); accepts 4MiB etc.",
        json_schema_extra={"metavar": "BYTES", "unit": "bytes"},
    )
    # A long agent session has hundreds of messages; every message costs a few tokens of template
    # even when empty, so 4096 of them fill most contexts (docs/server.md, "Limits").
    max_chat_messages: int = Field(
        4096,
        gt=0,
        description="Most messages (and most content parts) in one chat request; more is a 400.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level."
    )

    # --- LoRA adapters (docs/lora.md; --enable-lora) ---
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="LoRA adapters to serve, as NAME=PATH (a PEFT directory); a request "
        "picks one by `model`. Needs --enable-lora.",
        json_schema_extra={"nargs": "+", "metavar": "NAME=PATH"},
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key when "
        "set). Needs --enable-lora.",
    )

    # --- tools and structured outputs (docs/structured_outputs.md, "Limits") ---
    max_tools: int = Field(
        128, gt=0, description="Most tools in one chat request (OpenAI: 128); more is a 400."
    )
    stats_log_interval: float = Field(
        5.0, ge=0, description="Seconds between throughput log lines while busy (0: off)."
    )

    # --- slow and hostile clients ---
    stream_idle_timeout: float = Field(
        60.0,
        ge=0,
        description="Close a connection (and abort its request, freeing its seat and KV blocks) when "
        "the client has read nothing for this many seconds while the response waits to be written (0: off).",
    )
    header_timeout: float = Field(
        10.0,
        ge=0,
        description="Close a connection that has not sent complete request headers after this many "
        "seconds (0: off).",
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="Close an idle kept-alive connection after this many seconds."
    )
    max_connections: int | None = Field(
        None,
        gt=0,
        description="Most open client connections: beyond it the oldest idle one (or, if none is "
        "idle, the new one) is closed (unset: the open-file limit minus 128).",
    )

    # --- failures and shutdown ---
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM/SIGINT, seconds in-flight requests may take to finish (new ones "
        "get 503); then open streams get an error event and the server exits.",
    )
    keep_alive_on_engine_death: bool = Field(
        False,
        description="Keep serving (/health 503, requests 503) after the engine died instead of exiting "
        "with code 1; for debugging.",
    )

    @field_validator("served_model_name", "cors_origin", "api_key", "lora_modules", mode="before")
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
        for name in ("lora_modules", "allow_runtime_lora_updating"):
            if getattr(self, name) and not self.enable_lora:
                raise ValueError(f"--{name.replace('_', '-')} needs --enable-lora")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `engine.EngineArgs`."""
        return {name: getattr(self, name) for name in ENGINE_OPTIONS}

    def grammar_limits(self) -> GrammarLimits:
        return self.to_dataclass().structured_outputs_config().limits

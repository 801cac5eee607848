"""Engine configuration: user-facing `EngineArgs`, split into frozen, validated sub-configs.

`EngineArgs` is the one place an engine option is written: its default, type, choices and help.
Everything else is derived from it: `kvserve serve`, `kvserve ray` and the `KVSERVE_*`
environment variables (server/config.py, server/flags.py), and the sub-configs each component
receives (`ModelConfig`, `CacheConfig`, ...), which name the options they carry and take their
defaults and choices from here (`sub_config`). Each sub-config's `__post_init__` is the one
check of its values, for every entry point alike. Adding an option is one `option(...)` field
on `EngineArgs`, plus its name in the sub-config of the component that reads it.

Values discovered at run time (the KV pool size, EOS ids, the model's context length)
are not written back here: they live in `RuntimeInfo`, which the runner returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, dataclass_transform

from kvserve.engine.generation_config import GenerationConfig, check_mode
from kvserve.engine.pooling_params import TASKS, PoolerConfig
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.models.backends import (
    ATTENTION_BACKENDS,
    DEFAULT_GROUP_SIZE,
    QUANTIZATION_METHODS,
    check_quantization,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES_PREFIXES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")

_Config = TypeVar("_Config")
_SubConfig = TypeVar("_SubConfig", bound="DataclassInstance")


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    unit: str | None = None,
    server_default: Any = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """An options dataclass field (`EngineArgs`, and the server's `RayServeOptions`) with what the
    CLIs show for it: `help`, `choices`, a `metavar`, a `unit` ("bytes": the server also reads
    4GiB, 512MB), other flag spellings (`aliases`), and `server_default` where `kvserve serve`
    defaults differently from the offline API (a server bounds what the library leaves open)."""
    metadata = {
        "help": help,
        "choices": choices,
        "metavar": metavar,
        "unit": unit,
        "aliases": aliases,
    }
    if server_default is not None:
        metadata["server_default"] = server_default
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything a user can set; `LLM(**kwargs)` and `kvserve serve` flags map onto it."""

    model: str | None = option(
        None,
        "Checkpoint directory, GGUF file (or a directory holding one) or Hub id; unset serves the embedded "
        "default model.",
        metavar="PATH_OR_ID",
    )
    tokenizer: str | None = option(
        None, "Tokenizer directory or Hub id (default: the model's).", metavar="PATH_OR_ID"
    )
    dtype: str = option(
        "auto",
        "Weight/activation dtype (auto: bf16 on CUDA and on CPUs with bf16 units, else fp32).",
        choices=DTYPES,
    )
    device: str = option("auto", "Device: auto, cpu, cuda, cuda:N.")
    block_size: int = option(16, "Tokens per KV-cache block.")
    max_num_seqs: int = option(256, "Most sequences in one running batch.")
    max_num_batched_tokens: int = option(2048, "Token budget of one engine step.")
    scheduling_policy: str = option(
        "fcfs",
        "fcfs: first come, first served; priority: requests' `priority` orders the queue (lower first, "
        "then by arrival) and preemption takes the lowest priority first.",
        choices=SCHEDULING_POLICIES,
    )
    kv_cache_memory: int | None = option(
        None,
        "Bytes for the KV cache; accepts 4GiB, 512MB, 1e9 (unset: on CUDA what "
        "--gpu-memory-utilization leaves after the profiled step; on the CPU 32k "
        "tokens, at most RAM/4 and 4 GiB).",
        metavar="BYTES",
        unit="bytes",
    )
    num_kv_blocks: int | None = option(
        None, "Exact number of KV blocks (overrides --kv-cache-memory)."
    )
    enable_prefix_caching: bool = option(True, "Reuse KV blocks of shared prompt prefixes.")
    seed: int = option(0, "Engine random seed.")
    max_model_len: int | None = option(None, "Context length limit (default: the model's).")
    attention_backend: str = option(
        "auto",
        "Attention kernels: auto (cpu on CPU, triton on CUDA), torch (portable reference), cpu, triton.",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = option(
        False,
        "Run every step through the model's Python forward (no CUDA graphs; on the CPU, no C++ decoder stack).",
    )
    gpu_memory_utilization: float = option(
        0.9, "CUDA: share of the GPU's memory kvserve may use (weights, activations, KV)."
    )
    tensor_parallel_size: int = option(
        1, "Split the model over N devices (N GPUs; on the CPU, N processes): docs/scaling.md."
    )
    quantization: str | None = option(
        None,
        "Weights int8 or int4 (groups along the input, llama.cpp's Q8_0 / Q4_0), or fp8 (e4m3, for "
        "GPUs), quantized at load; none keeps the checkpoint's. Unset: a GGUF file's own type, else none. "
        "docs/quantization.md.",
        choices=QUANTIZATION_METHODS,
    )
    quantization_group_size: int = option(
        DEFAULT_GROUP_SIZE,
        "Input features per quantization scale (a multiple of 16 dividing every matrix's input).",
    )
    task: str | None = option(
        None,
        "generate: completions and chat (and /v1/embeddings from the LM's hidden states); embed: "
        "/v1/embeddings only. Unset: embed for an embedding checkpoint (no LM head, or sentence-transformers' "
        "modules.json), else generate.",
        choices=TASKS,
    )
    generation_config: str = option(
        "auto",
        "The generation_config.json applied as transformers' generate() applies it: auto (the model "
        "folder's), vllm (none: kvserve's defaults), or a folder holding one. Its sampling and beam settings "
        "become defaults a request overrides; its no_repeat_ngram_size, bad_words_ids, min_length, "
        "min_new_tokens and forced BOS/EOS apply to every request. docs/generation_config.md.",
        metavar="auto|vllm|FOLDER",
    )
    speculative_config: str | None = option(
        None,
        'Speculative decoding, as JSON (a dict offline): {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}. Unset: off. docs/speculative.md.',
        metavar="JSON",
    )
    # LoRA adapters (LoRAConfig)
    enable_lora: bool = option(
        False, "Serve LoRA adapters on the base model (Llama, Mistral, Qwen2, Qwen3): docs/lora.md."
    )
    max_loras: int = option(1, "Most distinct LoRA adapters in one batch (device slots).")
    max_lora_rank: int = option(16, "Largest LoRA rank an adapter may have.")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept read in host memory (default: max_loras)."
    )
    # structured outputs (StructuredOutputsConfig, GrammarLimits). The JSON Schema bounds are OpenAI's
    # Structured Outputs limits (max_schema_depth counts every subschema, OpenAI only objects); the others
    # have no OpenAI counterpart and are set an order of magnitude above realistic use.
    grammar_compile_timeout_s: float = option(
        20.0,
        "Seconds a request may wait for its grammar (queue and compile); then it fails with a 400 "
        "(or an error event).",
    )
    max_grammar_queue: int | None = option(
        None,
        "Most distinct grammars queued or compiling at once; a request needing one more is refused for now "
        "(503 from the server; unset: no limit).",
        server_default=64,
    )
    grammar_compile_threads: int | None = option(
        None,
        "Grammar compile threads, at a low CPU priority (nice 10; unset: one per two cores, at most 2).",
    )
    max_schema_properties: int = option(
        5000, "Most object properties in one JSON schema (OpenAI: 5000)."
    )
    max_schema_depth: int = option(
        32,
        "Deepest nesting of a JSON schema, every subschema counting one level "
        "(OpenAI: 10 object levels).",
    )
    max_schema_enum_values: int = option(
        1000, "Most enum values in one JSON schema (OpenAI: 1000)."
    )
    max_schema_string_chars: int = option(
        120_000,
        "Most characters of property names, enum and const values and patterns "
        "in one JSON schema (OpenAI: 120000).",
    )
    max_regex_chars: int = option(10_000, "Longest guided_regex.")
    max_grammar_chars: int = option(100_000, "Longest guided_grammar (EBNF).")
    max_choices: int = option(1000, "Most strings in a guided_choice.")
    max_choice_chars: int = option(
        120_000, "Most characters in a guided_choice, all strings together."
    )
    # the engine core process (AsyncLLM, the server)
    max_consecutive_step_failures: int = option(
        3,
        "Failed engine steps in a row after which the engine counts as dead (one failed step fails only its "
        "requests).",
    )

    def model_config(self) -> ModelConfig:
        return self.derive(ModelConfig)

    def cache_config(self) -> CacheConfig:
        return self.derive(CacheConfig)

    def scheduler_config(self) -> SchedulerConfig:
        return self.derive(
            SchedulerConfig, max_lora_slots=self.max_loras if self.enable_lora else 0
        )

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings (checked whether or not LoRA is on); None when it is off."""
        config = self.derive(LoRAConfig)
        return config if self.enable_lora else None

    def parallel_config(self) -> ParallelConfig:
        return self.derive(ParallelConfig)

    def core_config(self) -> CoreConfig:
        return self.derive(CoreConfig)

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def structured_outputs_config(self) -> StructuredOutputsConfig:
        return self.derive(StructuredOutputsConfig, limits=self.derive(GrammarLimits))

    def derive(self, config: type[_SubConfig], **values: Any) -> _SubConfig:
        """`config` (a `sub_config`) with this object's values of its options, by name."""
        names = [f.name for f in dataclasses.fields(config) if f.name not in values]
        return config(**{name: getattr(self, name) for name in names}, **values)

    def validate(self) -> None:
        """Raise ValueError for any bad value (each sub-config checks its own fields)."""
        self.model_config()
        self.cache_config()
        self.scheduler_config()
        self.parallel_config()
        self.core_config()
        self.lora_config()
        self.structured_outputs_config()
        self.speculative()


OPTIONS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(EngineArgs)}


def check_choices(options: Any, declared: dict[str, dataclasses.Field[Any]] | None = None) -> None:
    """ValueError for a field of the dataclass `options` whose value is not one of the `choices` its
    `option(...)` declares (found in `declared` by name, else on `options` itself); None passes
    where None is the option's default."""
    for f in dataclasses.fields(options):
        spec = (declared or {}).get(f.name, f)
        choices, value = spec.metadata.get("choices"), getattr(options, f.name)
        if choices and value not in choices and not (value is None and spec.default is None):
            raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")


@dataclass_transform(frozen_default=True)
def sub_config(cls: type[_Config]) -> type[_Config]:
    """Make `cls` a frozen, slotted dataclass of some of `EngineArgs`' options. The class body names
    each option it carries with its type (checked against `EngineArgs`) and no default: the default
    is the option's, and values outside the option's choices are refused after `cls`' own checks.
    Fields that are not options (a nested sub-config) declare their own default."""
    for name, annotation in cls.__annotations__.items():
        if name not in OPTIONS:
            continue
        if name in cls.__dict__:
            raise TypeError(
                f"{cls.__name__}.{name} has a default of its own; EngineArgs.{name} declares it"
            )
        if annotation != OPTIONS[name].type:
            raise TypeError(
                f"{cls.__name__}.{name}: {annotation} is not EngineArgs.{name}'s {OPTIONS[name].type}"
            )
        setattr(cls, name, OPTIONS[name].default)
    own_checks = cls.__dict__.get("__post_init__")

    def __post_init__(self: Any) -> None:
        if own_checks is not None:
            own_checks(self)
        check_choices(self, OPTIONS)

    cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
    return dataclass(frozen=True, slots=True)(cls)


def _check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@sub_config
class ModelConfig:
    model: str | None  # local dir, .gguf file or hub id; None = the embedded default model
    tokenizer: str | None
    dtype: str
    device: str
    seed: int
    max_model_len: int | None  # None = the model's own limit
    attention_backend: str  # auto: the device's best, cpu on CPU, triton on CUDA
    enforce_eager: (
        bool  # the model's Python forward every step: no CUDA graphs, no CPU decoder stack
    )
    gpu_memory_utilization: float  # share of the GPU's total memory kvserve may take
    quantization: str | None  # int8, int4, fp8, none; None: a GGUF file's own, else none
    quantization_group_size: int
    task: str | None  # generate, embed; None: embed for an embedding checkpoint, else generate
    generation_config: str  # auto | vllm | a folder (engine/generation_config.py)

    def __post_init__(self) -> None:
        check_quantization(self.quantization, self.quantization_group_size)
        check_mode(self.generation_config)
        if not isinstance(self.device, str) or not self.device.startswith(_DEVICES_PREFIXES):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _check_positive("max_model_len", self.max_model_len, allow_none=True)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if (
            isinstance(self.gpu_memory_utilization, bool)
            or not isinstance(self.gpu_memory_utilization, (int, float))
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )


@sub_config
class CacheConfig:
    block_size: int
    kv_cache_memory: int | None  # bytes for the whole pool (all layers, K and V)
    num_kv_blocks: int | None  # overrides kv_cache_memory; includes the null block
    enable_prefix_caching: bool

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        _check_positive("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        _check_positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}"
            )


@sub_config
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # fcfs: by arrival; priority: by (priority, arrival), lower value first (engine/core/scheduler.py)
    scheduling_policy: str
    max_lora_slots: int = (
        0  # most distinct LoRA adapters in the running batch (--max-loras); 0: LoRA off
    )

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)


@sub_config
class LoRAConfig:
    """LoRA adapters (docs/lora.md): `max_loras` device slots of rank <= `max_lora_rank`, and up to
    `max_cpu_loras` (None: `max_loras`) adapters kept read on the host."""

    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None

    def __post_init__(self) -> None:
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        _check_positive("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@sub_config
class ParallelConfig:
    """Tensor parallelism: the model split over `tensor_parallel_size` ranks (docs/scaling.md).
    Whether the model's heads divide is checked once its config is read (the engine)."""

    tensor_parallel_size: int

    def __post_init__(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)


@sub_config
class CoreConfig:
    """How the engine core process (engine/core/engine_core.py) treats steps that raise."""

    max_consecutive_step_failures: int

    def __post_init__(self) -> None:
        _check_positive("max_consecutive_step_failures", self.max_consecutive_step_failures)


@sub_config
class GrammarLimits:
    """Bounds on one request's output constraint; each is a `ValueError` (HTTP 400) naming it
    (engine/structured_output/limits.py checks them).

    `max_schema_*` apply to a JSON Schema (response_format json_schema, tool parameters,
    `structured_outputs.json`): object properties in all, nesting depth (each subschema under
    `properties`, `items`, `anyOf`, ... is one level deeper), enum values in all, and the
    characters of property and definition names, enum and const values and patterns together.
    """

    max_schema_properties: int
    max_schema_depth: int
    max_schema_enum_values: int
    max_schema_string_chars: int
    max_regex_chars: int
    max_grammar_chars: int
    max_choices: int
    max_choice_chars: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_positive(f.name, getattr(self, f.name))


@sub_config
class StructuredOutputsConfig:
    """Grammar compiling (engine/structured_output/grammar.py): how big a constraint may be, how long a
    request waits for its grammar, how many distinct grammars may be queued or compiling (None:
    no bound), and on how many threads (None: half the host's cores, 1 or 2)."""

    grammar_compile_timeout_s: float
    max_grammar_queue: int | None
    grammar_compile_threads: int | None
    limits: GrammarLimits = field(default_factory=GrammarLimits)  # type: ignore[arg-type]  # (sub_config defaults)

    def __post_init__(self) -> None:
        timeout_s = self.grammar_compile_timeout_s
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not timeout_s > 0
        ):
            raise ValueError(
                f"grammar_compile_timeout_s must be a positive number, got {timeout_s!r}"
            )
        _check_positive("max_grammar_queue", self.max_grammar_queue, allow_none=True)
        _check_positive("grammar_compile_threads", self.grammar_compile_threads, allow_none=True)


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """Facts found while loading: what the engine actually runs with."""

    model_path: str
    architecture: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int  # including the null block
    block_size: int
    attention_backend: str = "torch"  # the backend the loader chose
    cuda_graphs: bool = False  # decode steps replay CUDA graphs
    tensor_parallel_size: int = 1
    quantization: str = "none"  # what the weights are held as: none, int8, int4, fp8
    weight_bytes: int = 0  # resident bytes of the weights (this rank's under tensor parallelism)
    # encoder-decoder models: the decoder's first token (the prompt is the encoder's input); None otherwise
    decoder_start_token_id: int | None = None
    task: str = "generate"  # "generate" | "embed" (engine/pooling_params.py)
    pooler: PoolerConfig | None = None  # embedding defaults; None: the model cannot embed
    # the generation config applied (--generation-config): request defaults and processors
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.decoder_start_token_id is not None

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size

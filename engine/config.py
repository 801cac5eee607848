"""Engine configuration: user-facing `EngineArgs`, split into frozen, validated sub-configs.

`EngineArgs` is the one place an engine option is written: its default, type, choices and help.
`kvserve serve`, `kvserve ray` and the `KVSERVE_*` environment variables are generated from it
(server/config.py), and the sub-configs' `__post_init__` validate the values for every entry
point alike.

Values discovered at run time (the KV pool size, EOS ids, the model's context length)
are not written back here: they live in `RuntimeInfo`, which the runner returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.structured_output.limits import GrammarLimits
from kvserve.engine.spec_decode.proposer import SpeculativeConfig
from kvserve.models.backends import (ATTENTION_BACKENDS, DEFAULT_GROUP_SIZE, QUANTIZATION_METHODS,
                                     check_quantization)

_LIMITS = GrammarLimits()  # the defaults

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES_PREFIXES = ("auto", "cpu", "cuda")


def _check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None  # local dir, .gguf file or hub id; None = the embedded default model
    tokenizer: str | None
    dtype: str
    device: str
    seed: int
    max_model_len: int | None  # None = the model's own limit
    attention_backend: str = "auto"  # the device's best: cpu on CPU, triton on CUDA
    enforce_eager: bool = False  # the model's Python forward every step: no CUDA graphs, no CPU decoder stack
    gpu_memory_utilization: float = 0.9  # share of the GPU's total memory kvserve may take
    quantization: str | None = None  # int8, int4, fp8, none; None: a GGUF file's own, else none
    quantization_group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        check_quantization(self.quantization, self.quantization_group_size)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not self.device.startswith(_DEVICES_PREFIXES):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _check_positive("max_model_len", self.max_model_len, allow_none=True)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


@dataclass(frozen=True, slots=True)
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
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # fcfs: by arrival; priority: by (priority, arrival), lower value first (engine/core/scheduler.py)
    policy: str = "fcfs"
    max_loras: int = 0  # most distinct LoRA adapters in the running batch; 0 = LoRA off

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: the model split over `tensor_parallel_size` ranks (docs/scaling.md).
    Whether the model's heads divide is checked once its config is read (the engine)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters (docs/lora.md): `max_loras` device slots of rank <= `max_lora_rank`, and up to
    `max_cpu_loras` adapters kept read on the host."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        _check_positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Grammar compiling (engine/structured_output/grammar.py): how big a constraint may be, how long a
    request waits for its grammar, how many distinct grammars may be queued or compiling (None:
    no bound), and on how many threads (None: half the host's cores, 1 or 2)."""

    limits: GrammarLimits = field(default_factory=GrammarLimits)
    compile_timeout_s: float = 20.0
    max_queue: int | None = None
    compile_threads: int | None = None

    def __post_init__(self) -> None:
        if (isinstance(self.compile_timeout_s, bool) or not isinstance(self.compile_timeout_s, (int, float))
                or not self.compile_timeout_s > 0):
            raise ValueError(f"grammar_compile_timeout_s must be a positive number, got {self.compile_timeout_s!r}")
        _check_positive("max_grammar_queue", self.max_queue, allow_none=True)
        _check_positive("grammar_compile_threads", self.compile_threads, allow_none=True)


def option(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,
           unit: str | None = None, server_default: Any = None, aliases: tuple[str, ...] = ()) -> Any:
    """An options dataclass field (`EngineArgs`, and the server's `RayServeOptions`) with what the
    CLIs show for it: `help`, `choices`, a `metavar`, a `unit` ("bytes": the server also reads
    4GiB, 512MB), other flag spellings (`aliases`), and `server_default` where `kvserve serve`
    defaults differently from the offline API (a server bounds what the library leaves open)."""
    metadata = {"help": help, "choices": choices, "metavar": metavar, "unit": unit, "aliases": aliases}
    if server_default is not None:
        metadata["server_default"] = server_default
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything a user can set; `LLM(**kwargs)` and `kvserve serve` flags map onto it."""

    model: str | None = option(
        None, "Checkpoint directory, GGUF file (or a directory holding one) or Hub id; unset serves the embedded "
        "default model.", metavar="PATH_OR_ID")
    tokenizer: str | None = option(None, "Tokenizer directory or Hub id (default: the model's).",
                                   metavar="PATH_OR_ID")
    dtype: str = option("auto", "Weight/activation dtype (auto: bf16 on CUDA and on CPUs with bf16 units, "
                        "else fp32).", choices=DTYPES)
    device: str = option("auto", "Device: auto, cpu, cuda, cuda:N.")
    block_size: int = option(16, "Tokens per KV-cache block.")
    max_num_seqs: int = option(256, "Most sequences in one running batch.")
    max_num_batched_tokens: int = option(2048, "Token budget of one engine step.")
    scheduling_policy: str = option(
        "fcfs", "fcfs: first come, first served; priority: requests' `priority` orders the queue (lower first, "
        "then by arrival) and preemption takes the lowest priority first.", choices=SCHEDULING_POLICIES)
    kv_cache_memory: int | None = option(None, "Bytes for the KV cache; accepts 4GiB, 512MB, 1e9.",
                                         metavar="BYTES", unit="bytes")
    num_kv_blocks: int | None = option(None, "Exact number of KV blocks (overrides --kv-cache-memory).")
    enable_prefix_caching: bool = option(True, "Reuse KV blocks of shared prompt prefixes.")
    seed: int = option(0, "Engine random seed.")
    max_model_len: int | None = option(None, "Context length limit (default: the model's).")
    attention_backend: str = option(
        "auto", "Attention kernels: auto (cpu on CPU, triton on CUDA), torch (portable reference), cpu, triton.",
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(
        False, "Run every step through the model's Python forward (no CUDA graphs; on the CPU, no C++ decoder stack).")
    gpu_memory_utilization: float = option(
        0.9, "CUDA: share of the GPU's memory kvserve may use (weights, activations, KV).")
    tensor_parallel_size: int = option(
        1, "Split the model over N devices (N GPUs; on the CPU, N processes): docs/scaling.md.")
    quantization: str | None = option(
        None, "Weights int8 or int4 (groups along the input, llama.cpp's Q8_0 / Q4_0), or fp8 (e4m3, for "
        "GPUs), quantized at load; none keeps the checkpoint's. Unset: a GGUF file's own type, else none. "
        "docs/quantization.md.",
        choices=QUANTIZATION_METHODS)
    quantization_group_size: int = option(
        DEFAULT_GROUP_SIZE, "Input features per quantization scale (a multiple of 16 dividing every matrix's input).")
    speculative_config: str | None = option(
        None, 'Speculative decoding, as JSON (a dict offline): {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}. Unset: off. docs/speculative.md.', metavar="JSON")
    # LoRA adapters (LoRAConfig)
    enable_lora: bool = option(False, "Serve LoRA adapters on the base model (Llama, Mistral, Qwen2, Qwen3): "
                               "docs/lora.md.")
    max_loras: int = option(1, "Most distinct LoRA adapters in one batch (device slots).")
    max_lora_rank: int = option(16, "Largest LoRA rank an adapter may have.")
    max_cpu_loras: int | None = option(None, "LoRA adapters kept read in host memory (default: max_loras).")
    # structured outputs (StructuredOutputsConfig, GrammarLimits)
    grammar_compile_timeout_s: float = option(
        20.0, "Seconds a request may wait for its grammar (queue and compile); then it fails with a 400 "
        "(or an error event).")
    max_grammar_queue: int | None = option(
        None, "Most distinct grammars queued or compiling at once; a request needing one more is refused for now "
        "(503 from the server; unset: no limit).", server_default=64)
    grammar_compile_threads: int | None = option(
        None, "Grammar compile threads, at a low CPU priority (nice 10; unset: one per two cores, at most 2).")
    max_schema_properties: int = option(
        _LIMITS.max_schema_properties, "Most object properties in one JSON schema (OpenAI: 5000).")
    max_schema_depth: int = option(
        _LIMITS.max_schema_depth, "Deepest nesting of a JSON schema, every subschema counting one level "
        "(OpenAI: 10 object levels).")
    max_schema_enum_values: int = option(
        _LIMITS.max_schema_enum_values, "Most enum values in one JSON schema (OpenAI: 1000).")
    max_schema_string_chars: int = option(
        _LIMITS.max_schema_string_chars, "Most characters of property names, enum and const values and patterns "
        "in one JSON schema (OpenAI: 120000).")
    max_regex_chars: int = option(_LIMITS.max_regex_chars, "Longest guided_regex.")
    max_grammar_chars: int = option(_LIMITS.max_grammar_chars, "Longest guided_grammar (EBNF).")
    max_choices: int = option(_LIMITS.max_choices, "Most strings in a guided_choice.")
    max_choice_chars: int = option(_LIMITS.max_choice_chars, "Most characters in a guided_choice, all strings "
                                   "together.")

    def model_config(self) -> ModelConfig:
        return ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, device=self.device,
                           seed=self.seed, max_model_len=self.max_model_len, attention_backend=self.attention_backend,
                           enforce_eager=self.enforce_eager, gpu_memory_utilization=self.gpu_memory_utilization,
                           quantization=self.quantization, quantization_group_size=self.quantization_group_size)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                           num_kv_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.scheduling_policy,
                               self.max_loras if self.enable_lora else 0)

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank,
                          self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size)

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def structured_outputs_config(self) -> StructuredOutputsConfig:
        limits = GrammarLimits(
            max_schema_properties=self.max_schema_properties, max_schema_depth=self.max_schema_depth,
            max_schema_enum_values=self.max_schema_enum_values, max_schema_string_chars=self.max_schema_string_chars,
            max_regex_chars=self.max_regex_chars, max_grammar_chars=self.max_grammar_chars,
            max_choices=self.max_choices, max_choice_chars=self.max_choice_chars)
        return StructuredOutputsConfig(limits=limits, compile_timeout_s=self.grammar_compile_timeout_s,
                                       max_queue=self.max_grammar_queue, compile_threads=self.grammar_compile_threads)

    def validate(self) -> None:
        """Raise ValueError for any bad value (each sub-config checks its own fields)."""
        self.model_config()
        self.cache_config()
        self.scheduler_config()
        self.parallel_config()
        self.lora_config()
        self.structured_outputs_config()
        self.speculative()


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

    @property
    def is_encoder_decoder(self) -> bool:
        return self.decoder_start_token_id is not None

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size

"""What the server needs from an engine: `engine.AsyncLLM`, or a scripted fake in tests.

A structural type (Protocol), so the tests' fake engine needs no base class and the server
never reaches for attributes with `getattr` fallbacks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvserve.engine.generation_config import GenerationConfig
    from kvserve.engine.lora_request import LoRARequest
    from kvserve.engine.outputs import EngineStats, RequestOutput
    from kvserve.engine.pooling_params import PoolerConfig, PoolingParams
    from kvserve.engine.sampling_params import SamplingParams


class ModelInfo(Protocol):
    """The loaded model's facts the server reports (`engine.config.RuntimeInfo` has them all)."""

    model_path: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    quantization: str  # none, int8, int4, fp8
    weight_bytes: int
    eos_token_ids: tuple[int, ...]
    decoder_start_token_id: int | None  # encoder-decoder models only
    task: str  # "generate" | "embed"
    pooler: PoolerConfig | None  # embedding defaults; None: the model cannot embed
    generation_config: GenerationConfig  # --generation-config: request defaults and processors


class ServingEngine(Protocol):
    """An engine the server can run requests on and report about."""

    tokenizer: Any   # a transformers tokenizer (not imported here: the server starts without torch)
    chat_template: str | None

    @property
    def model_config(self) -> ModelInfo: ...

    @property
    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def generate(self, prompt: Sequence[int] | dict[str, Any], params: SamplingParams | PoolingParams,
                 request_id: str, lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """`prompt`: token ids, or `{"prompt_token_ids": [...], "cache_salt": str}`; `lora_request`
        (passed only when a request names an adapter): its LoRA adapter."""

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...

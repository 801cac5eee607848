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

    @property
    def model_path(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def quantization(self) -> str: ...  # none, int8, int4, fp8
    @property
    def weight_bytes(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def decoder_start_token_id(self) -> int | None: ...  # encoder-decoder models only
    @property
    def task(self) -> str: ...  # "generate" | "embed"
    @property
    def pooler(self) -> PoolerConfig | None: ...  # embedding defaults; None: the model cannot embed
    @property
    def generation_config(
        self,
    ) -> GenerationConfig: ...  # --generation-config: request defaults and processors


class ServingEngine(Protocol):
    """An engine the server can run requests on and report about."""

    tokenizer: Any  # a transformers tokenizer (not imported here: the server starts without torch)
    chat_template: str | None

    @property
    def model_config(self) -> ModelInfo: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine died; None while it runs and after a requested `shutdown()`."""

    def stats(self) -> EngineStats: ...

    def wait_ready(self) -> None:
        """Block until the model is loaded (called where the server owns the engine)."""

    def generate(
        self,
        prompt: Sequence[int] | dict[str, Any],
        params: SamplingParams | PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """`prompt`: token ids, or `{"prompt_token_ids": [...], "cache_salt": str}`; `lora_request`
        (passed only when a request names an adapter): its LoRA adapter."""

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...

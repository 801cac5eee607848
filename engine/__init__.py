"""kvserve engine: paged KV cache, continuous batching, batched sampling.

    from kvserve.engine import LLM, SamplingParams
    outs = LLM(model="path/to/checkpoint").generate(["Hello"], SamplingParams(max_tokens=32))

Importing the package imports no torch (the server's process never does): the executor loads
it when an engine is built.
"""

from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvserve.engine.config import EngineArgs
from kvserve.engine.errors import EngineDeadError, EngineOverloadedError, EngineShutDownError
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EngineStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from kvserve.engine.pooling_params import PoolingParams
from kvserve.engine.sampling_params import SamplingParams, StructuredOutputs

__all__ = [
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineShutDownError",
    "EngineStats",
    "LLM",
    "LLMEngine",
    "Logprob",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
]

"""kvserve engine: paged KV cache, continuous batching, batched sampling.

    from engine import LLM, SamplingParams
    outs = LLM(model="path/to/checkpoint").generate(["Hello"], SamplingParams(max_tokens=32))

Names are imported lazily, so `import engine.scheduler` stays free of torch.
"""

import importlib

_EXPORTS = {
    "AsyncLLM": "engine.async_llm",
    "EngineDeadError": "engine.errors",
    "EngineOverloadedError": "engine.errors",
    "EngineShutDownError": "engine.errors",
    "EngineArgs": "engine.config",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "CompletionOutput": "engine.outputs",
    "EngineStats": "engine.outputs",
    "Logprob": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputs": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

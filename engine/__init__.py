"""kvserve engine: paged KV cache, continuous batching, batched sampling.

    from kvserve.engine import LLM, SamplingParams
    outs = LLM(model="path/to/checkpoint").generate(["Hello"], SamplingParams(max_tokens=32))

Names are imported lazily, so `import kvserve.engine.scheduler` stays free of torch.
"""

import importlib

_EXPORTS = {
    "AsyncLLM": "kvserve.engine.async_llm",
    "BeamSearchOutput": "kvserve.engine.beam_search",
    "BeamSearchParams": "kvserve.engine.beam_search",
    "BeamSearchSequence": "kvserve.engine.beam_search",
    "EngineDeadError": "kvserve.engine.errors",
    "EngineOverloadedError": "kvserve.engine.errors",
    "EngineShutDownError": "kvserve.engine.errors",
    "EngineArgs": "kvserve.engine.config",
    "LLM": "kvserve.engine.llm",
    "LLMEngine": "kvserve.engine.llm_engine",
    "CompletionOutput": "kvserve.engine.outputs",
    "EngineStats": "kvserve.engine.outputs",
    "Logprob": "kvserve.engine.outputs",
    "RequestMetrics": "kvserve.engine.outputs",
    "RequestOutput": "kvserve.engine.outputs",
    "SamplingParams": "kvserve.engine.sampling_params",
    "StructuredOutputs": "kvserve.engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

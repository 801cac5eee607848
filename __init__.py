"""kvserve: a small, exact, fast inference server.

    from kvserve import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint")

The installed package maps the repository's folders: `kvserve.engine` (scheduling, paged KV
cache, sampling, the offline and async APIs), `kvserve.models` (model files and loaders),
`kvserve.server` (the OpenAI-compatible HTTP server and CLI) and `kvserve.loadtest` (the load
generator). Names are imported lazily, so `import kvserve` stays light.
"""

from __future__ import annotations

import importlib

from kvserve.engine import __all__ as _engine_names

__all__ = list(_engine_names)


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("kvserve.engine"), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")

"""kvserve HTTP server: an OpenAI-compatible API, Prometheus metrics and the `kvserve` CLI.

`server` imports `engine`, never the other way. Handlers validate requests at the
edge (`server.validation`) and talk to the engine only through
`AsyncLLM.generate` / `AsyncLLM.abort` / `AsyncLLM.stats`.
"""

from __future__ import annotations


def package_version() -> str:
    """The installed kvserve version, or "0.1.0" when running from a plain checkout."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("kvserve")
    except (ImportError, PackageNotFoundError):
        return "0.1.0"


__all__ = ["package_version"]

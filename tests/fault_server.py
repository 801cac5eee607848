"""`python tests/fault_server.py SPEC serve ...`: `kvserve serve ...` whose engine core wraps its
executor in a `FaultyExecutor` failing the steps SPEC names (tests/faulty_executor.py).

Run as a script, so that this folder is on the path of the engine core process too (it unpickles
the wrapper there)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from faulty_executor import faults
    from kvserve.engine import async_llm

    wrapper = faults(sys.argv.pop(1))
    start = async_llm.AsyncLLM.__init__

    def start_with_faults(self, *args, **kwargs) -> None:
        start(self, *args, executor_wrapper=wrapper, **kwargs)

    async_llm.AsyncLLM.__init__ = start_with_faults
    from kvserve.server.cli import main

    raise SystemExit(main())

"""Handing freed heap memory back to the OS, without importing torch (the API server uses it too)."""

from __future__ import annotations

import ctypes
import gc


def release_free_memory(collect_cycles: bool = True) -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). Loading weights frees staged
    float matrices and a GGUF file's parsed metadata; loading a tokenizer frees its parsed JSON.
    glibc keeps freed heap memory mapped, so the process's resident memory would stay that much
    above its live data. `collect_cycles=False` skips the full garbage collection first: reference
    counting already freed what loading dropped, and a full collection in a process holding many
    objects (the user's, for the offline API) is slow."""
    if collect_cycles:
        gc.collect()
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return
    trim(0)

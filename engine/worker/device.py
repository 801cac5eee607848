"""Device and dtype choice, and how much memory the KV cache may take by default."""

from __future__ import annotations

import os

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_CACHE_MAX_BYTES = 4 * 2**30


def resolve_device(device: str) -> torch.device:
    """ "auto", "cpu", "cuda" or "cuda:N"; a CUDA device always comes back with its index
    (torch.cuda.set_device and per-rank placement need one)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def cpu_has_fast_bf16() -> bool:
    """A kernel set of models/cpu_ops runs here (AVX-512 BF16, AVX2 or NEON): its bf16 matmuls
    read half of fp32's bytes and beat fp32 at every batch size (docs/performance.md)."""
    from kvserve.models import cpu_ops

    return cpu_ops.load() and cpu_ops.has_fast_bf16()


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """ "auto": bf16 on CUDA; on CPU bf16 where a CPU kernel set runs (docs/performance.md: it
    halves the weight traffic that bounds decode), else fp32."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def kv_cache_budget_bytes(device: torch.device) -> int:
    """The most memory a default CPU KV pool may take (engine/worker/kv_pool.py picks its size within it;
    on CUDA the runner's memory profile gives the budget instead)."""
    return min(_cpu_available_bytes() // 4, _CPU_KV_CACHE_MAX_BYTES)

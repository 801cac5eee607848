"""The paged KV pool: how many blocks it gets, and the per-layer cache tensors.

Sizing, in order: `num_kv_blocks` if given, else `kv_cache_memory` bytes, else a default.
The default on CUDA is 85% of the free memory (`engine.worker.device.kv_cache_budget_bytes`). On
the CPU it is `DEFAULT_CPU_KV_TOKENS` (llama-server's 32k cells), or one full-length
sequence when the context is longer, capped by a quarter of available RAM (at most 4 GiB):
a CPU decodes a few dozen sequences at a time, so a pool for `max_num_seqs` full-length
sequences would be memory it never uses. No default ever exceeds what `max_num_seqs`
full-length sequences could fill.

On the CPU the pool is an anonymous mapping (`models.hugepages.zeros`): the OS hands out
zeroed pages on first touch, so allocating it writes nothing, and unused slots hold zeros
(attention needs them finite). CUDA keeps `torch.zeros`. The server's engine core then faults
the pages in from a background thread once it is ready (`prefault`), so that the first busy
steps do not pay for page faults (the offline `LLM` leaves them to first touch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kvserve.engine.config import CacheConfig, SchedulerConfig
from kvserve.engine.worker.device import kv_cache_budget_bytes
from kvserve.models import hugepages
from kvserve.models.timing import phase

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_TOKENS = 32768


class KVLayer(Protocol):
    """What the pool needs of an attention layer; it sets `kv_cache`."""

    num_kv_heads: int
    head_dim: int
    kv_cache: torch.Tensor | None


def bytes_per_block(layers: Sequence[KVLayer], block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block over all layers."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * elem for layer in layers)


def num_blocks_for(
    cache: CacheConfig,
    sched: SchedulerConfig,
    max_model_len: int,
    block_bytes: int,
    device: torch.device,
    budget_bytes: int | None = None,
) -> int:
    """The pool's block count, including the null block 0; ValueError when fewer than 2.
    `budget_bytes`: what a memory profile left for the pool (default: `kv_cache_budget_bytes`)."""
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    elif cache.kv_cache_memory is not None:
        num_blocks = cache.kv_cache_memory // block_bytes
    else:
        blocks_per_seq = -(-max_model_len // cache.block_size)
        max_useful = sched.max_num_seqs * blocks_per_seq + 1  # what the largest batch could fill
        budget = (
            kv_cache_budget_bytes(device) if budget_bytes is None else budget_bytes
        ) // block_bytes
        if device.type == "cpu":
            wanted_tokens = max(DEFAULT_CPU_KV_TOKENS, max_model_len)
            budget = min(budget, -(-wanted_tokens // cache.block_size) + 1)
        num_blocks = min(budget, max_useful)
    if num_blocks < 2:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks of {block_bytes} bytes; "
            f"raise kv_cache_memory (got {cache.kv_cache_memory})"
        )
    return num_blocks


def allocate_kv_pool(
    layers: Sequence[KVLayer],
    cache: CacheConfig,
    sched: SchedulerConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    budget_bytes: int | None = None,
) -> int:
    """Size the pool, give each layer its zeroed `kv_cache`, return the block count (null block included)."""
    block_bytes = bytes_per_block(layers, cache.block_size, dtype)
    num_blocks = num_blocks_for(cache, sched, max_model_len, block_bytes, device, budget_bytes)
    with phase("KV pool"):
        for layer in layers:
            # [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block
            shape = (2, num_blocks, cache.block_size, layer.num_kv_heads, layer.head_dim)
            if device.type == "cpu":  # zero pages on first touch; huge pages spare TLB misses
                layer.kv_cache = hugepages.zeros(shape, dtype)
            else:
                layer.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)",
        num_blocks - 1,
        cache.block_size,
        (num_blocks - 1) * cache.block_size,
        num_blocks * block_bytes / 2**20,
    )
    return num_blocks


def prefault(layers: Sequence[KVLayer]) -> None:
    """Fault in a CPU pool's pages now (a background thread's job: each chunk releases the GIL)."""
    start = time.perf_counter()
    caches = [
        layer.kv_cache
        for layer in layers
        if layer.kv_cache is not None and layer.kv_cache.device.type == "cpu"
    ]
    if caches and all(hugepages.populate(cache) for cache in caches):
        logger.info(
            "KV pool faulted in (%.1f MiB) in %.2f s",
            sum(c.numel() * c.element_size() for c in caches) / 2**20,
            time.perf_counter() - start,
        )

"""The attention layer the model files use, and the interface of the backends that do its
device-specific work."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.models.attention.backend import reference_backend


class AttentionBackend:
    name = "base"
    index_dtype = (
        torch.int64
    )  # of the metadata's slot_mapping / block_table / seq_lens / cu_seqlens_q
    supports_cuda_graphs = (
        False  # its decode path depends on no host value that changes between steps
    )

    def forward(self, layer: Attention, qkv: Tensor) -> Tensor:
        """qkv [T, (H + 2 KvH) * D] (rows may be strided) -> [T, H * D]: rotary on q and k,
        the new K/V into the layer's cache, then causal attention over the cache."""
        raise NotImplementedError


class Attention(nn.Module):
    """Causal (optionally sliding-window) attention of new tokens over the paged KV cache.

    Takes the packed projections qkv [T, (H + 2 KvH) * D], applies `rotary` (a shared
    `RotaryEmbedding`, or None) to q and k, writes k and v into `kv_cache` and attends.
    `logit_softcap` = c (Gemma 2) caps the scaled scores s as `c * tanh(s / c)` before the mask
    and the softmax.
    `kv_cache` is assigned by the runner: [2, num_blocks, block_size, num_kv_heads,
    head_dim] (0 = keys, 1 = values; block 0 is the null block); until then (e.g. a
    profiling pass) the layer can only run prefills without a cached prefix. `backend`
    is the torch reference until the loader sets the device's (`select_backend`).
    """

    # bumped by every `kv_cache` assignment (of any layer): what holds the caches' pointers (the
    # CPU decoder stack) checks this one number each step instead of every layer's cache
    cache_assignments = 0

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        rotary: nn.Module | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)
        self.rotary = rotary
        self.backend: AttentionBackend = reference_backend()
        self._kv_cache: Tensor | None = None
        self.kv: tuple[Tensor, Tensor] | None = None  # the cache's K and V halves, views made once

    @property
    def kv_cache(self) -> Tensor | None:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: Tensor | None) -> None:
        if cache is not None and (
            cache.dim() != 5
            or cache.shape[0] != 2
            or tuple(cache.shape[3:]) != (self.num_kv_heads, self.head_dim)
        ):
            raise ValueError(
                f"kv_cache must be [2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                f"got {tuple(cache.shape)}"
            )
        self._kv_cache = cache
        self.kv = None if cache is None else (cache[0], cache[1])
        Attention.cache_assignments += 1

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, logit_softcap={self.logit_softcap}, "
            f"backend={self.backend.name}"
        )

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[T, (H + 2 KvH) * D] -> views q [T, H, D], k [T, KvH, D], v [T, KvH, D]."""
        num_tokens, qk = qkv.shape[0], self.q_size + self.kv_size
        return (
            qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim),
            qkv[:, self.q_size : qk].view(num_tokens, self.num_kv_heads, self.head_dim),
            qkv[:, qk:].view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def forward(self, qkv: Tensor) -> Tensor:  # [T, (H + 2 KvH) * D] -> [T, H * D]
        return self.backend.forward(self, qkv)

"""What every attention layer of one step shares: the step's metadata and a scoped context.

The runner builds one `AttentionMetadata` per step and runs the model inside
`forward_context(meta)`. Each `Attention` layer reads it from there (never through
the model's arguments); step-level work derived from it (a backend's plan, the
rotary cos/sin rows of the step's positions) is done once, by the first layer that
asks, and shared by the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class AttentionMetadata:
    """Device tensors in the backend's index dtype (`AttentionBackend.index_dtype`), plus host scalars."""

    slot_mapping: Tensor  # [T] block_id * block_size + offset where each new token's K/V goes; -1: padding row
    positions: Tensor  # [T] each token's position in its sequence
    cu_seqlens_q: Tensor  # [B+1] request i's new tokens are rows cu[i]:cu[i+1]
    seq_lens: Tensor  # [B] context length after this step (cached + new)
    block_table: Tensor  # [B, max_blocks] unused entries 0 (the null block)
    query_lens_cpu: list[int]  # [B] host copies, so attention needs no device->host sync
    seq_lens_cpu: list[int]  # [B]
    block_size: int
    max_query_len: int
    max_seq_len: int  # an upper bound of seq_lens (CUDA graphs capture with max_model_len)
    # encoder-decoder models (models/seq2seq.py): each request's cross blocks (its encoder output's
    # K/V) and its encoder length; None for decoder-only models
    cross_block_table: Tensor | None = None  # [B, max_cross_blocks]
    cross_lens_cpu: list[int] | None = None  # [B]

    @property
    def is_all_decode(self) -> bool:
        """Every request has one new token (rows past B, if any, are padding)."""
        return self.max_query_len == 1


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    _cache: dict[Any, Any] = field(default_factory=dict)

    def once(self, key: Any, build: Callable[[], Any]) -> Any:
        """`build()` the first time `key` is asked for in this step, the same object afterwards."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "kvserve_forward_context", default=None
)


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `meta` visible to every `Attention` layer for the duration of the block (restored on exit)."""
    token = _CURRENT.set(ForwardContext(meta))
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def current_context() -> ForwardContext:
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError("Attention must run inside models.attention.forward_context(meta)")
    return context


def get_forward_context() -> AttentionMetadata | None:
    """The metadata of the enclosing `forward_context`, or None outside one."""
    context = _CURRENT.get()
    return None if context is None else context.meta

"""The paged-cache side of the encoder-decoder models (models/bart.py, models/t5.py), in PyTorch.

Each decoder layer owns one `Attention` module as its cache holder: the runner gives it a
`kv_cache` from the same pool as every other model's, and the layer keeps two kinds of blocks
in it. A request's decoder K/V go to its ordinary blocks (the block table, filled as the
decoder runs, causal); its encoder output, projected once to this layer's cross-attention K/V
when the request is encoded, goes to its cross blocks (`AttentionMetadata.cross_block_table`,
`cross_lens_cpu`: one table row per scheduled request), read without a mask.

Attention here is one SDPA call per request over its gathered blocks: the reference the
kernels will be checked against, not the fast path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvserve.models.attention import Attention, AttentionMetadata


def kv_holder(num_heads: int, head_dim: int) -> Attention:
    """A decoder layer's cache holder: an `Attention` the runner sizes the pool for and fills."""
    return Attention(num_heads, num_heads, head_dim, scale=1.0)


def write_kv(holder: Attention, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """k, v [N, H, D] into the holder's cache at flat slots [N] (block_id * block_size + offset)."""
    k_cache, v_cache = holder.kv
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


def gather_kv(holder: Attention, block_ids: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The first `length` K/V [length, H, D] of the blocks `block_ids` (in order)."""
    k_cache, v_cache = holder.kv
    num_blocks = -(-length // k_cache.shape[1])
    blocks = block_ids[:num_blocks]
    return (k_cache[blocks].flatten(0, 1)[:length], v_cache[blocks].flatten(0, 1)[:length])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """q [Lq, H, D] over k, v [Lk, H, D] (mask: additive [H or 1, Lq, Lk] or None) -> [Lq, H * D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).to(q.dtype),
                                         v.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@dataclass(frozen=True, slots=True)
class RequestRows:
    """One scheduled request of the step, as the decoder's attention needs it."""

    start: int  # its first row in the flat batch
    query_len: int
    seq_len: int  # decoder tokens with K/V after this step
    block_ids: Tensor  # its block-table row
    cross_block_ids: Tensor  # its cross blocks
    cross_len: int  # encoder tokens

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.query_len)

    def causal_mask(self, device: torch.device) -> Tensor:
        """Additive [1, Lq, Lk]: query j (position seq_len - query_len + j) sees keys up to itself."""
        query_pos = torch.arange(self.seq_len - self.query_len, self.seq_len, device=device)[:, None]
        future = torch.arange(self.seq_len, device=device)[None, :] > query_pos
        return torch.zeros(future.shape, device=device).masked_fill(future, float("-inf"))[None]


def request_rows(meta: AttentionMetadata) -> Iterator[RequestRows]:
    starts = [0]
    for length in meta.query_lens_cpu:
        starts.append(starts[-1] + length)
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        yield RequestRows(starts[i], query_len, seq_len, meta.block_table[i], meta.cross_block_table[i],
                          meta.cross_lens_cpu[i])


def segments(cu_seqlens: list[int]) -> Iterator[slice]:
    """Row ranges of the requests in a flat batch with cumulative lengths `cu_seqlens` [B+1]."""
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        yield slice(start, stop)

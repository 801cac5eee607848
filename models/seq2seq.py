"""The paged-cache side of the encoder-decoder models (models/bart.py, models/t5.py), in PyTorch.

Each decoder layer owns one `Attention` module as its cache holder: the runner gives it a
`kv_cache` from the same pool as every other model's, and the layer keeps two kinds of blocks
in it. A request's decoder K/V go to its ordinary blocks (the block table, filled as the
decoder runs, causal); its encoder output, projected once to this layer's cross-attention K/V
when the request is encoded, goes to its cross blocks (`AttentionMetadata.cross_block_table`,
`cross_lens_cpu`: one table row per scheduled request), read without a mask.

Attention here is PyTorch's SDPA over gathered blocks: the decode rows of a step (one new token
each) together in one call per layer, their keys padded to the longest and masked; every other
request (a decoder prompt, a chunk) in a call of its own. The reference the kernels will be
checked against, not the fast path.
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


@dataclass
class StepPlan:
    """What every decoder layer of one step shares: the requests' rows, and for the decode rows
    (one new token each) the row indices, block tables and key masks of one batched call."""

    rows: list[RequestRows]
    prefill: list[RequestRows]  # the requests with more than one new token: one call each
    decode_index: Tensor | None  # [Bd] flat row of each decode row; None when there are none
    self_table: Tensor | None  # [Bd, blocks] block tables, as many blocks as the longest needs
    self_mask: Tensor | None  # [Bd, 1, 1, keys] additive: -inf past each row's sequence
    self_lens: Tensor | None  # [Bd]
    cross_table: Tensor | None
    cross_mask: Tensor | None


def step_plan(meta: AttentionMetadata, device: torch.device) -> StepPlan:
    rows = list(request_rows(meta))
    decode = [r for r in rows if r.query_len == 1]
    prefill = [r for r in rows if r.query_len != 1]
    if not decode:
        return StepPlan(rows, prefill, None, None, None, None, None, None)
    bs = meta.block_size
    index = torch.tensor([r.start for r in decode], device=device)

    def table_and_mask(lengths: list[int], tables: list[Tensor]) -> tuple[Tensor, Tensor]:
        num_blocks = -(-max(lengths) // bs)
        table = torch.stack([t[:num_blocks] if t.shape[0] >= num_blocks
                             else F.pad(t, (0, num_blocks - t.shape[0])) for t in tables])
        past = torch.arange(num_blocks * bs, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
        mask = torch.zeros(past.shape, device=device).masked_fill(past, float("-inf"))[:, None, None, :]
        return table, mask

    self_lens = [r.seq_len for r in decode]
    self_table, self_mask = table_and_mask(self_lens, [r.block_ids for r in decode])
    cross_table, cross_mask = table_and_mask([r.cross_len for r in decode], [r.cross_block_ids for r in decode])
    return StepPlan(rows, prefill, index, self_table, self_mask, torch.tensor(self_lens, device=device),
                    cross_table, cross_mask)


def paged_attention(holder: Attention, q: Tensor, plan: StepPlan, scale: float, cross: bool,
                    prefill_masks: list[Tensor | None], decode_bias: Tensor | None = None) -> Tensor:
    """q [T, H, D] of the step's rows over each request's own (cross=False, causal through
    `prefill_masks` / `plan.self_mask`) or cross blocks (unmasked) -> [T, H * D].
    `decode_bias` [Bd, H, 1, keys]: a per-head additive bias for the decode rows (T5's), mask included."""
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    if plan.decode_index is not None:
        k_cache, v_cache = holder.kv
        table = plan.cross_table if cross else plan.self_table
        keys = k_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [Bd, H, L, D]
        values = v_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)
        mask = plan.cross_mask if cross else (decode_bias if decode_bias is not None else plan.self_mask)
        rows = q[plan.decode_index][:, :, None, :]  # [Bd, H, 1, D]
        attended = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask.to(q.dtype), scale=scale)
        out[plan.decode_index] = attended.flatten(1)
    for r, mask in zip(plan.prefill, prefill_masks):
        blocks, length = (r.cross_block_ids, r.cross_len) if cross else (r.block_ids, r.seq_len)
        out[r.rows] = attend(q[r.rows], *gather_kv(holder, blocks, length), None if cross else mask, scale)
    return out


def segments(cu_seqlens: list[int]) -> Iterator[slice]:
    """Row ranges of the requests in a flat batch with cumulative lengths `cu_seqlens` [B+1]."""
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        yield slice(start, stop)

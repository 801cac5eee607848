"""The paged-cache side of the encoder-decoder models (models/bart.py, models/t5.py), in PyTorch.

Each decoder layer owns one `Attention` module as its cache holder: the runner gives it a
`kv_cache` from the same pool as every other model's, and the layer keeps two kinds of blocks
in it. A request's decoder K/V go to its ordinary blocks (the block table, filled as the
decoder runs, causal); its encoder output, projected once to this layer's cross-attention K/V
when the request is encoded, goes to its cross blocks (`AttentionMetadata.cross_block_table`,
`cross_lens_cpu`: one table row per scheduled request), read without a mask.

With a paged decode kernel (models/cpu_ops' with a kernel set loaded, in bf16, or Triton's), every row
of a step is attended in one call per layer, reading the blocks in place: a prompt row is a query
that sees the keys up to its own position, cross-attention is the kernel over the cross blocks,
T5's relative bias the kernel's per-distance bias table. Elsewhere the decode rows go to one
PyTorch SDPA call over gathered blocks, their keys padded to the longest and masked, and every
other request (a decoder prompt, a chunk) to an SDPA call of its own: the reference the kernels
are checked against.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvserve.models import cpu_ops
from kvserve.models.attention import Attention, AttentionMetadata


def kv_holder(num_heads: int, head_dim: int) -> Attention:
    """A decoder layer's cache holder: an `Attention` the runner sizes the pool for and fills."""
    return Attention(num_heads, num_heads, head_dim, scale=1.0)


def write_kv(holder: Attention, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """k, v [N, H, D] into the holder's cache at flat slots [N] (block_id * block_size + offset),
    by its backend (the CPU's: one fused op for both)."""
    k_cache, v_cache = holder.kv
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if hasattr(holder.backend, "write_kv"):  # the torch and CPU backends
        holder.backend.write_kv(holder, k, v, slots)
    else:
        slots = slots.long()
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def gather_kv(holder: Attention, block_ids: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The first `length` K/V [length, H, D] of the blocks `block_ids` (in order)."""
    k_cache, v_cache = holder.kv
    num_blocks = -(-length // k_cache.shape[1])
    blocks = block_ids[:num_blocks]
    return (k_cache[blocks].flatten(0, 1)[:length], v_cache[blocks].flatten(0, 1)[:length])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None) -> Tensor:
    """q [Lq, H, D] over k, v [Lk, H, D] (mask: additive [H or 1, Lq, Lk] or None) -> [Lq, H * D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).to(q.dtype),
        v.transpose(0, 1).to(q.dtype),
        attn_mask=mask,
        scale=scale,
    )
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
        query_pos = torch.arange(self.seq_len - self.query_len, self.seq_len, device=device)[
            :, None
        ]
        future = torch.arange(self.seq_len, device=device)[None, :] > query_pos
        return torch.zeros(future.shape, device=device).masked_fill(future, float("-inf"))[None]


def request_rows(meta: AttentionMetadata) -> Iterator[RequestRows]:
    starts = [0]
    for length in meta.query_lens_cpu:
        starts.append(starts[-1] + length)
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        yield RequestRows(
            starts[i],
            query_len,
            seq_len,
            meta.block_table[i],
            meta.cross_block_table[i],
            meta.cross_lens_cpu[i],
        )


@dataclass
class StepPlan:
    """What every decoder layer of one step shares: the requests' rows, and the row indices, block
    tables and lengths of one batched attention call. With `kernels` (models/cpu_ops' paged decode
    kernel, chosen at load: `uses_kernels`) that call takes every row of the step, each a query
    over its request's table rows; otherwise only the decode rows (one new token each), their
    tables padded to the longest and masked for SDPA, and `prefill` lists the other requests."""

    rows: list[RequestRows]
    prefill: list[RequestRows]  # the requests with more than one new token: one call each
    kernels: bool
    decode_index: Tensor | None = (
        None  # reference path: [Bd] flat row of each decode row; None if none
    )
    # [Bd] rows (the kernel path: every row of the step), in the backend's index dtype
    self_table: Tensor | None = None  # [Bd, blocks]
    self_lens: Tensor | None = None  # [Bd]
    cross_table: Tensor | None = None
    cross_lens: Tensor | None = None
    self_mask: Tensor | None = (
        None  # reference path: [Bd, 1, 1, keys] additive, -inf past each row's sequence
    )
    cross_mask: Tensor | None = None
    max_self_len: int = (
        0  # kernel path: the longest row of each kind (Triton's kernel splits by it)
    )
    max_cross_len: int = 0


def uses_kernels(holder: Attention) -> bool:
    """Whether the step's rows go to a paged decode kernel: the backend chosen at load has one, the
    CPU's (bf16 with a kernel set loaded, head_dim a multiple of 32) or Triton's."""
    return holder.backend.name == "triton" or bool(getattr(holder.backend, "paged_kernels", False))


def step_plan(meta: AttentionMetadata, device: torch.device, kernels: bool = False) -> StepPlan:
    rows = list(request_rows(meta))
    if kernels:
        return _kernel_plan(meta, rows, device)
    decode = [r for r in rows if r.query_len == 1]
    prefill = [r for r in rows if r.query_len != 1]
    if not decode:
        return StepPlan(rows, prefill, kernels)
    index = torch.tensor([r.start for r in decode], device=device)
    self_lens = torch.tensor([r.seq_len for r in decode], device=device)
    cross_lens = torch.tensor([r.cross_len for r in decode], device=device)
    bs = meta.block_size

    def padded(lengths: Tensor, tables: list[Tensor]) -> tuple[Tensor, Tensor]:
        num_blocks = -(-int(lengths.max()) // bs)
        table = torch.stack(
            [
                t[:num_blocks]
                if t.shape[0] >= num_blocks
                else F.pad(t, (0, num_blocks - t.shape[0]))
                for t in tables
            ]
        )
        past = torch.arange(num_blocks * bs, device=device)[None, :] >= lengths[:, None]
        mask = torch.zeros(past.shape, device=device).masked_fill(past, float("-inf"))[
            :, None, None, :
        ]
        return table, mask

    self_table, self_mask = padded(self_lens, [r.block_ids for r in decode])
    cross_table, cross_mask = padded(cross_lens, [r.cross_block_ids for r in decode])
    return StepPlan(
        rows,
        prefill,
        kernels,
        index,
        self_table,
        self_lens,
        cross_table,
        cross_lens,
        self_mask,
        cross_mask,
    )


def _kernel_plan(
    meta: AttentionMetadata, rows: list[RequestRows], device: torch.device
) -> StepPlan:
    """Every row of the step as a decode row of the kernel: row j of a request with L new tokens
    and S decoder tokens is a query at position S - L + j that sees its first S - L + j + 1 keys
    (causal) and all of the request's encoder output; its table rows are the request's."""
    num_rows = sum(r.query_len for r in rows)
    index = meta.block_table.dtype  # the backend's: int64 for the CPU's kernel, int32 for Triton's
    if num_rows == len(rows):  # all decode rows: the tables as they are
        self_table, cross_table = meta.block_table[:num_rows], meta.cross_block_table[:num_rows]
        self_lens = [r.seq_len for r in rows]
    else:
        owner = torch.tensor(
            [i for i, r in enumerate(rows) for _ in range(r.query_len)], device=device
        )
        self_table, cross_table = meta.block_table[owner], meta.cross_block_table[owner]
        self_lens = [r.seq_len - r.query_len + 1 + j for r in rows for j in range(r.query_len)]
    cross_lens = [r.cross_len for r in rows for _ in range(r.query_len)]
    return StepPlan(
        rows,
        [],
        True,
        None,
        self_table,
        torch.tensor(self_lens, dtype=index, device=device),
        cross_table.to(index),
        torch.tensor(cross_lens, dtype=index, device=device),
        max_self_len=max(self_lens),
        max_cross_len=max(cross_lens),
    )


def paged_attention(
    holder: Attention,
    q: Tensor,
    plan: StepPlan,
    scale: float,
    cross: bool,
    prefill_masks: list[Tensor | None],
    decode_bias: Tensor | None = None,
) -> Tensor:
    """q [T, H, D] of the step's rows over each request's own (cross=False, causal) or cross blocks
    (unmasked) -> [T, H * D]. With `plan.kernels`, every row in one kernel call; otherwise the
    decode rows in one SDPA call (`plan.self_mask` / `plan.cross_mask`) and each other request in
    its own (`prefill_masks`). `decode_bias`, self-attention only (T5's): with `plan.kernels` a
    float32 [H, L] table by distance from the query (`cpu_ops.paged_decode_attention`'s), else
    [Bd, H, 1, keys] with the mask added."""
    table, lens = (
        (plan.cross_table, plan.cross_lens) if cross else (plan.self_table, plan.self_lens)
    )
    if plan.kernels and holder.backend.name == "triton":
        from kvserve.models.kernels import (
            triton_attention,  # imports triton: only where it was chosen
        )

        longest = plan.max_cross_len if cross else plan.max_self_len
        return triton_attention.paged_decode_attention(
            q, *holder.kv, table, lens, scale, None, longest, bias=decode_bias
        ).flatten(1)
    if plan.kernels:
        return cpu_ops.paged_decode_attention(q, *holder.kv, table, lens, scale, None, decode_bias)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    if plan.decode_index is not None:
        k_cache, v_cache = holder.kv
        keys = k_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [Bd, H, L, D]
        values = v_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)
        mask = (
            plan.cross_mask
            if cross
            else (decode_bias if decode_bias is not None else plan.self_mask)
        )
        rows = q[plan.decode_index][:, :, None, :]  # [Bd, H, 1, D]
        attended = F.scaled_dot_product_attention(
            rows, keys, values, attn_mask=mask.to(q.dtype), scale=scale
        )
        out[plan.decode_index] = attended.flatten(1)
    for r, mask in zip(plan.prefill, prefill_masks):
        blocks, length = (r.cross_block_ids, r.cross_len) if cross else (r.block_ids, r.seq_len)
        out[r.rows] = attend(
            q[r.rows], *gather_kv(holder, blocks, length), None if cross else mask, scale
        )
    return out


def attend_segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segs: list[slice],
    masks: list[Tensor | None],
    scale: float | None,
) -> Tensor:
    """Bidirectional attention within each request of a flat batch (the encoder's): q, k, v [S, H, D]
    with rows `segs[i]` for request i, masks additive [H, L, L] or None -> [S, H * D]."""
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for rows, mask in zip(segs, masks):
        out[rows] = attend(q[rows], k[rows], v[rows], mask, scale)
    return out


def segments(cu_seqlens: list[int]) -> Iterator[slice]:
    """Row ranges of the requests in a flat batch with cumulative lengths `cu_seqlens` [B+1]."""
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        yield slice(start, stop)

"""Paged attention in Triton: flash-decoding for decode steps, a varlen kernel for everything else.

Cache layout. `k_cache` and `v_cache` are each `[num_blocks, block_size, num_kv_heads, head_dim]`
(the two halves of the runner's `[2, ...]` tensor). Block 0 is the null block. Request r's token
at position p lives in block `block_table[r, p // block_size]` at offset `p % block_size`. The
step's new K/V are already in the cache, so both kernels read every key and value from it, in
place through the block table: each tile of `BLOCK_N` key positions looks up its blocks row by row
(any block_size works; a key row is `head_dim` contiguous elements), with no gather copy.

Masking (HF Llama/Mistral/Qwen2): the query at position i sees keys j with j <= i and, when
`sliding_window` = W is set, j > i - W. With `softcap` = c (Gemma 2) each scaled score s becomes
c * tanh(s / c) before the mask (HF's order). Scores and softmax are fp32 (exp2 with the scale folded
in), outputs are in q's dtype. GQA/MQA: query head h reads kv head h // G, G = H / KvH; every
program owns one kv head and all G of its query heads, so each K/V tile is loaded once for them
(rows padded with zeros to >= 16 for `tl.dot`).

Decode (`paged_decode_attention`, one new token per request, at position seq_len - 1):
  1. `_decode_partition_kernel`, grid (B, KvH, num_splits): split-K over the context in
     partitions of `DECODE_PARTITION_SIZE` keys; each program runs an online softmax over its
     partition and writes a partial output (already divided by its sum) and its log-sum-exp (base 2).
     num_splits = min(cdiv(max_seq_len, partition), DECODE_MAX_SPLITS) comes from the host int
     `max_seq_len` only, so the grid is fixed for CUDA graphs: a program whose partition starts
     at/after its row's seq_len, or ends before the row's window, loops zero times and writes
     lse = -inf. A row longer than num_splits partitions gets longer partitions (so the workspace
     [B, H, num_splits, D] fp32 stays bounded, and a max_seq_len below a real seq_len is slower,
     never wrong). Tiles wholly before the window are skipped.
  2. `_decode_reduce_kernel`, grid (B, H): combines the partials weighted by exp2(lse - max lse).
     With one split the first kernel writes the output itself and there is no second launch.
  Padding rows (seq_len 0) get zeros; seq_len 1 on a null-block row reads block 0 (finite when
  the pool is zeroed, as the runner's is).

Prefill (`paged_prefill_attention`, a ragged batch of any query lengths, 1 included):
  `_prefill_kernel`, grid (B, cdiv(max_query_len, BLOCK_Q), KvH), one launch. A program takes
  BLOCK_Q consecutive query tokens of one request times the G heads of one kv head (a
  [BLOCK_Q * G, head_dim] block of rows) and runs an online softmax (flash-attention 2) over the
  keys from the window start of its first query to its last query, cached prefix included.
  Programs past a request's query_len do nothing. Rows of `out` past cu_seqlens_q[B] are not written.

Both functions are also torch custom ops (`torch.ops.kvserve.triton_paged_decode_attention` and
`...paged_prefill_attention`, mutating `out`, with fake impls), so torch.compile and CUDA graphs
treat them as opaque. The tile sizes below are module constants (tests shrink them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvserve.models.kernels import fix_interpreter_scalar_index

DECODE_PARTITION_SIZE = 512  # keys per split-K partition (rounded to a multiple of DECODE_BLOCK_N)
DECODE_MAX_SPLITS = 32  # bounds the partials' workspace; longer rows get longer partitions
DECODE_BLOCK_N = 64  # keys per tile in the decode kernel
PREFILL_BLOCK_M = 64  # query rows (tokens x heads of one kv head) per prefill program
PREFILL_BLOCK_N = 64  # keys per tile in the prefill kernel (32 for head_dim > 128)
REDUCE_SPLIT_TILE = 16  # partials combined per step of the reduce kernel
_LOG2E = 1.4426950408889634


fix_interpreter_scalar_index()


@triton.jit
def _load_kv_tile(
    cache_ptr,
    block_table_row,
    pos,
    valid,
    kv_head,
    offs_d,
    d_mask,
    block_size,
    stride_b,
    stride_t,
    stride_h,
    EVEN_D: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] keys/values at positions `pos` of one request (zeros where not `valid`)."""
    block_ids = tl.load(block_table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
    rows = cache_ptr + block_ids * stride_b + (pos % block_size) * stride_t + kv_head * stride_h
    if EVEN_D:  # no column mask: keeps the loads vectorized
        return tl.load(rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    return tl.load(
        rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0
    )


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """Fold a [M, N] tile of base-2 scores (-inf where masked) and its [N, D] values into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet stay empty
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _softcap(s, softcap_log2):
    """c * tanh(s / c) for scores s in base-2 units (scaled by log2 e), given c * log2 e."""
    x = s / softcap_log2
    return softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))  # tanh, saturating at +-1


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    bias_ptr,
    qk_scale,
    sliding_window,
    block_size,
    num_splits,
    bias_len,
    softcap_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_bias_h,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # PARTITION_SIZE keys per split, more when the row is longer than num_splits partitions
    partition = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, PARTITION_SIZE)
    part_start = split * partition
    part_end = tl.minimum(part_start + partition, seq_len)
    win_start = 0
    if HAS_WINDOW:
        win_start = tl.maximum(seq_len - sliding_window, 0)
    tile_start = tl.maximum(
        part_start, win_start // BLOCK_N * BLOCK_N
    )  # skip tiles before the window

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G_PAD, BLOCK_D]
    block_table_row = block_table_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for n_start in range(tile_start, part_end, BLOCK_N):
        pos = n_start + tl.arange(0, BLOCK_N)
        valid = (pos < part_end) & (pos >= win_start)
        k = _load_kv_tile(
            k_ptr,
            block_table_row,
            pos,
            valid,
            kv_head,
            offs_d,
            d_mask,
            block_size,
            stride_kb,
            stride_kt,
            stride_kh,
            HEAD_DIM == BLOCK_D,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G_PAD, BLOCK_N]
        if HAS_SOFTCAP:
            s = _softcap(s, softcap_log2)
        if HAS_BIAS:  # by distance from the query: key `pos` reads column bias_len - seq_len + pos
            s += (
                tl.load(
                    bias_ptr + heads[:, None] * stride_bias_h + (bias_len - seq_len + pos)[None, :],
                    mask=g_mask[:, None] & valid[None, :],
                    other=0.0,
                )
                * 1.4426950408889634
            )
        s = tl.where(valid[None, :], s, float("-inf"))
        v = _load_kv_tile(
            v_ptr,
            block_table_row,
            pos,
            valid,
            kv_head,
            offs_d,
            d_mask,
            block_size,
            stride_vb,
            stride_vt,
            stride_vh,
            HEAD_DIM == BLOCK_D,
        )
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty partition gives zeros
    o_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT_OUT:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(
            part_out_ptr
            + b * stride_pb
            + heads[:, None] * stride_ph
            + split * stride_ps
            + offs_d[None, :],
            o,
            mask=o_mask,
        )
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        offs_s = s0 + tl.arange(0, SPLIT_TILE)
        s_mask = offs_s < num_splits
        lse = tl.load(
            part_lse_ptr + b * stride_lb + head * stride_lh + offs_s,
            mask=s_mask,
            other=float("-inf"),
        )  # [SPLIT_TILE]
        o = tl.load(
            part_out_ptr
            + b * stride_pb
            + head * stride_ph
            + offs_s[:, None] * stride_ps
            + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [SPLIT_TILE, BLOCK_D]
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)  # 0 for empty partitions
        l_i = l_i * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, None] * o, 0)[None, :]
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask[None, :],
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    sliding_window,
    block_size,
    softcap_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_q_ptr + r).to(tl.int32)
    query_len = tl.load(cu_seqlens_q_ptr + r + 1).to(tl.int32) - q_begin
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    context_len = seq_len - query_len  # the cached prefix before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    token = q_block * BLOCK_Q + offs_m // G  # [BLOCK_M] query index within the request
    heads = kv_head * G + offs_m % G
    row_mask = (offs_m < BLOCK_Q * G) & (token < query_len)
    q_pos = context_len + token
    q_rows = (q_begin + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    block_table_row = block_table_ptr + r.to(tl.int64) * stride_btb

    first_token = q_block * BLOCK_Q
    key_end = tl.minimum(
        context_len + first_token + BLOCK_Q, seq_len
    )  # past the block's last query
    key_end = tl.where(first_token < query_len, key_end, 0)  # programs past query_len do nothing
    key_start = 0
    if HAS_WINDOW:
        key_start = (
            tl.maximum(context_len + first_token - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n_start in range(key_start, key_end, BLOCK_N):
        pos = n_start + tl.arange(0, BLOCK_N)
        valid = pos < key_end
        k = _load_kv_tile(
            k_ptr,
            block_table_row,
            pos,
            valid,
            kv_head,
            offs_d,
            d_mask,
            block_size,
            stride_kb,
            stride_kt,
            stride_kh,
            HEAD_DIM == BLOCK_D,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = _softcap(s, softcap_log2)
        visible = pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible & valid[None, :], s, float("-inf"))
        v = _load_kv_tile(
            v_ptr,
            block_table_row,
            pos,
            valid,
            kv_head,
            offs_d,
            d_mask,
            block_size,
            stride_vb,
            stride_vt,
            stride_vh,
            HEAD_DIM == BLOCK_D,
        )
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _decode_config(dtype: torch.dtype, head_dim: int) -> dict:
    """Tile sizes and launch options (checked to compile for sm_90 without spills, in the tests).

    fp32 keeps ~fp32 products with 3xTF32 on tensor cores ("ieee" FMA dots spill badly) and
    halves the key tile for registers."""
    is_fp32 = dtype == torch.float32
    return dict(
        BLOCK_N=min(DECODE_BLOCK_N, 32) if is_fp32 else DECODE_BLOCK_N,
        DOT_PRECISION="tf32x3" if is_fp32 else "tf32",
        num_warps=8 if head_dim > 128 else 4,
        num_stages=2 if is_fp32 else 3,
    )


def _prefill_config(dtype: torch.dtype, head_dim: int, group: int) -> dict:
    is_fp32 = dtype == torch.float32
    block_m = max(
        min(PREFILL_BLOCK_M, 32) if is_fp32 else PREFILL_BLOCK_M, triton.next_power_of_2(group)
    )
    return dict(
        BLOCK_M=block_m,
        BLOCK_Q=block_m // group,
        BLOCK_N=PREFILL_BLOCK_N if head_dim <= 128 and not is_fp32 else min(PREFILL_BLOCK_N, 32),
        DOT_PRECISION="tf32x3" if is_fp32 else "tf32",
        num_warps=4 if head_dim <= 64 or is_fp32 else 8,
        num_stages=2,
    )


def _check_inputs(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> tuple[int, int]:
    """(G, head_dim) after the shape checks that need no device value."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, H, D] and k/v caches [num_blocks, block_size, KvH, D], got q "
            f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_heads} heads of {head_dim}, the cache {num_kv_heads} kv heads of "
            f"{k_cache.shape[3]}: head_dim must match and heads be a multiple of kv heads"
        )
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) dimension")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be int32/int64 [B, max_blocks], got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    return num_heads // num_kv_heads, head_dim


def _prepare_out(q: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(
            f"out must have q's shape {tuple(q.shape)} and a contiguous last dimension, "
            f"got {tuple(out.shape)} with strides {out.stride()}"
        )
    return out


@torch.library.custom_op("kvserve::triton_paged_decode_attention", mutates_args=("out",))
def _decode_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    max_seq_len: int,
    out: Tensor,
    bias: Tensor | None = None,
    softcap: float | None = None,
) -> None:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    config = _decode_config(q.dtype, head_dim)
    partition = max(DECODE_PARTITION_SIZE // config["BLOCK_N"], 1) * config["BLOCK_N"]
    num_splits = min(max(triton.cdiv(max_seq_len, partition), 1), DECODE_MAX_SPLITS)
    block_d = triton.next_power_of_2(head_dim)
    direct = num_splits == 1
    if direct:  # no workspace: the partition kernel writes `out`
        part_out = part_lse = out
        p_strides = (0, 0, 0, 0, 0)
    else:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
        p_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        part_out,
        part_lse,
        out if bias is None else bias,
        scale * _LOG2E,
        sliding_window or 0,
        k_cache.shape[1],
        num_splits,
        0 if bias is None else bias.shape[1],
        (softcap or 1.0) * _LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        *p_strides,
        0 if bias is None else bias.stride(0),
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PARTITION_SIZE=partition,
        HAS_WINDOW=sliding_window is not None,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        DIRECT_OUT=direct,
        **config,
    )
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            *p_strides,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            SPLIT_TILE=REDUCE_SPLIT_TILE,
            num_warps=4,
        )


@_decode_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    scale,
    sliding_window,
    max_seq_len,
    out,
    bias=None,
    softcap=None,
) -> None:
    return None


@torch.library.custom_op("kvserve::triton_paged_prefill_attention", mutates_args=("out",))
def _prefill_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
    out: Tensor,
    softcap: float | None = None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len <= 0:
        return
    config = _prefill_config(q.dtype, head_dim, group)
    _prefill_kernel[(num_seqs, triton.cdiv(max_query_len, config["BLOCK_Q"]), num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        out,
        scale * _LOG2E,
        sliding_window or 0,
        k_cache.shape[1],
        (softcap or 1.0) * _LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        **config,
    )


@_prefill_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    sliding_window,
    max_query_len,
    out,
    softcap=None,
) -> None:
    return None


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    max_seq_len: int,
    out: Tensor | None = None,
    bias: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """One new token per request: q [B, H, D] (row stride may exceed H*D) -> [B, H, D] in q's dtype.

    block_table [B, max_blocks] and seq_lens [B] (int32; context length including the new token)
    live on q's device. `max_seq_len` (host int) only sets the number of splits: any bound works,
    e.g. max_model_len under CUDA graphs. Rows with seq_len 0 (padding) give zeros. `bias`: float32
    [H, L] (L >= every seq_len) added to the scaled scores by distance from the query, key t of a
    row of length s getting bias[h, L - s + t] (T5's relative bias; models/cpu_ops has the same).
    `softcap`: Gemma 2's logit soft-capping of the scaled scores (see the module docstring).
    """
    _check_inputs(q, k_cache, v_cache, block_table, scale, sliding_window, softcap)
    if seq_lens.shape != (q.shape[0],) or block_table.shape[0] != q.shape[0]:
        raise ValueError(
            f"decode needs seq_lens [B] and block_table [B, max_blocks] for q of {q.shape[0]} "
            f"rows, got {tuple(seq_lens.shape)} and {tuple(block_table.shape)}"
        )
    if bias is not None and (
        bias.dtype != torch.float32
        or bias.dim() != 2
        or bias.shape[0] != q.shape[1]
        or (bias.stride(1) != 1 and bias.shape[1] > 1)
        or bias.shape[1] < max_seq_len
    ):
        raise ValueError(
            f"bias must be float32 [heads, >= max_seq_len] with contiguous rows, got "
            f"{bias.dtype} {tuple(bias.shape)} for {q.shape[1]} heads and max_seq_len {max_seq_len}"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = _prepare_out(q, out)
    if q.shape[0] > 0:
        torch.ops.kvserve.triton_paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            float(scale),
            sliding_window,
            int(max_seq_len),
            out,
            bias,
            None if softcap is None else float(softcap),
        )
    return out


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
    out: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """A ragged batch of queries, q [T, H, D] -> [T, H, D] in q's dtype, causal over the paged cache.

    Request r owns rows cu_seqlens_q[r]:cu_seqlens_q[r+1] (int32 [B+1]), its last query_len
    positions (seq_len - query_len .. seq_len - 1; a cached prefix may precede them).
    `max_query_len` (host int) must be >= every query_len. `softcap` as in `paged_decode_attention`.
    """
    _check_inputs(q, k_cache, v_cache, block_table, scale, sliding_window, softcap)
    num_seqs = seq_lens.shape[0]
    if (
        seq_lens.dim() != 1
        or cu_seqlens_q.shape != (num_seqs + 1,)
        or block_table.shape[0] != num_seqs
    ):
        raise ValueError(
            f"prefill needs seq_lens [B], cu_seqlens_q [B+1] and block_table [B, max_blocks], got "
            f"{tuple(seq_lens.shape)}, {tuple(cu_seqlens_q.shape)} and {tuple(block_table.shape)}"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = _prepare_out(q, out)
    torch.ops.kvserve.triton_paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        float(scale),
        sliding_window,
        int(max_query_len),
        out,
        None if softcap is None else float(softcap),
    )
    return out

"""Triton grouped GEMM for mixture-of-experts layers (models/moe.py), with no host sync.

The step's (token, expert) pairs are sorted by expert id (`group_by_expert`), so each expert's
rows are one contiguous run of the gathered input. The runs are cut into tiles of BM rows that
never straddle two experts, and one program computes one (tile, BN columns) block of
`rows @ W[e].T` for its tile's expert e: each expert's weights are read once per N block per
tile, and the experts no token chose are never read.

The tile table is built on the device from the per-expert counts with a fixed upper bound on
the number of tiles (`cdiv(pairs, BM) + E`): programs past the real tiles find no expert and
do nothing. Plain weights (fp32 / bf16 / fp16 [E, N, K]); fp32 accumulation (fp32 inputs
without TF32). Quantized experts use the per-expert Triton matmul instead (models/quantization.py).

Under TRITON_INTERPRET=1 it runs on the CPU, which is how tests/test_triton_moe.py checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvserve.models.kernels import fix_interpreter_scalar_index

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

fix_interpreter_scalar_index()  # the K loop's runtime bound, under TRITON_INTERPRET=1


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_stop_ptr,
    N,
    K,
    num_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_ym,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One program per (tile of one expert's rows, BN output columns): y[rows] = x[rows] @ W[e].T."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    has_rows = e < num_experts  # tiles past the last real one: no rows, no weight reads
    e = tl.minimum(e, num_experts - 1).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    stop = tl.load(tile_stop_ptr + tile)
    rows = start + tl.arange(0, BM)  # [BM]
    cols = pid_n * BN + tl.arange(0, BN)  # [BN]
    row_ok = (rows < stop) & has_rows
    col_ok = cols < N
    k_end = tl.where(has_rows, K, 0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        w = tl.load(
            w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + kk[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BN, BK]
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    y = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """x [P, K] rows sorted by expert (`counts[e]` rows of expert e, in order) @ W[e].T per run,
    w [E, N, K] -> [P, N] in x's dtype. ValueError naming anything that does not fit."""
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"x must be [P, K] float32/bfloat16/float16, got {tuple(x.shape)} {x.dtype}"
        )
    if w.dim() != 3 or w.shape[2] != x.shape[1] or w.dtype != x.dtype:
        raise ValueError(
            f"w must be {x.dtype} [E, N, {x.shape[1]}], got {tuple(w.shape)} {w.dtype}"
        )
    if counts.shape != (w.shape[0],):
        raise ValueError(
            f"counts must be [{w.shape[0]}] (one per expert), got {tuple(counts.shape)}"
        )
    p, k = x.shape
    n = w.shape[1]
    y = torch.empty(p, n, dtype=x.dtype, device=x.device)
    if p == 0:
        return y
    x, w = x.contiguous(), w.contiguous()
    bm, bn, bk = (16 if p <= 64 else 64), 64, 32
    expert, first, stop = tile_table(counts, bm, p)
    grid = (expert.shape[0], triton.cdiv(n, bn))
    _grouped_gemm_kernel[grid](
        x,
        w,
        y,
        expert,
        first,
        stop,
        n,
        k,
        w.shape[0],
        x.stride(0),
        w.stride(0),
        w.stride(1),
        y.stride(0),
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
    )
    return y


def tile_table(counts: Tensor, block_m: int, num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """counts [E] (rows per expert, `num_rows` in all) -> per tile (expert, first row, row stop), each
    [cdiv(num_rows, block_m) + E]: device ops only (the tile count is a bound the host knows);
    unused tiles have expert E."""
    num_experts = counts.shape[0]
    counts = counts.to(torch.int32)
    num_tiles = triton.cdiv(num_rows, block_m) + num_experts
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_stop = torch.cumsum(tiles, 0, dtype=torch.int32)  # [E] one past each expert's last tile
    row_stop = torch.cumsum(counts, 0, dtype=torch.int32)  # [E]
    t = torch.arange(num_tiles, device=counts.device, dtype=torch.int32)
    expert = torch.searchsorted(tile_stop, t, right=True).to(
        torch.int32
    )  # [tiles]: E past the last tile
    e = expert.clamp(max=num_experts - 1).long()
    first = row_stop[e] - counts[e] + (t - (tile_stop[e] - tiles[e])) * block_m
    return expert, first.to(torch.int32), row_stop[e]

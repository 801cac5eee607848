"""Triton batched LoRA (punica / S-LoRA style): each step's tokens grouped by adapter slot.

    shrink:  buf[t, :]  = x[t] @ A[slot(t)].T       buf [T, R] fp32, A [S, R, in]
    expand:  y[t, :]   += buf[t] @ B[slot(t)].T      y [T, out] (model dtype), B [S, out, R]

Only tokens that use an adapter are touched (base tokens keep the base linear's output). The
tokens come sorted by slot (`LoRABatchMeta.token_order`) in segments; program (m, n, seg) multiplies
rows m*BM.. of segment seg by columns n*BN.. of its slot's matrix, gathering and scattering the
rows by token index, fp32 accumulation (IEEE products for fp32 inputs: no TF32 rounding).
Both halves are one kernel, `ADD` telling expand (accumulate into y) from shrink (write buf).

Runs on CUDA; under TRITON_INTERPRET=1 on the CPU (tests/test_triton_lora.py checks it against
models/lora.py's torch reference). Not measured on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvserve.models.kernels import fix_interpreter_scalar_index
from kvserve.models.lora import LoRABatchMeta

fix_interpreter_scalar_index()  # the K loop's runtime bound, under TRITON_INTERPRET=1

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _sgmv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    order_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    N,
    K,
    stride_xm,
    stride_ws,
    stride_wn,
    stride_ym,
    ADD: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs = pid_m * BM + tl.arange(0, BM)  # [BM] rows of the segment
    row_ok = offs < length  # programs past a short segment's end touch nothing
    tokens = tl.load(order_ptr + start + offs, mask=row_ok, other=0).to(tl.int64)  # [BM]
    cols = pid_n * BN + tl.arange(0, BN)  # [BN]
    col_ok = cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        w = tl.load(
            w_ptr + slot * stride_ws + cols[:, None].to(tl.int64) * stride_wn + kk[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BN, BK]
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xm + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(w.dtype)  # [BM, BK]
        if (
            UPCAST
        ):  # the interpreter's bf16 / fp16 dot is wrong: its products in fp32 (exact anyway)
            acc += tl.dot(
                x.to(tl.float32),
                tl.trans(w.to(tl.float32)),
                input_precision="ieee",
                out_dtype=tl.float32,
            )
        elif IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    out = y_ptr + tokens[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ADD:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: Tensor, w: Tensor, y: Tensor, meta: LoRABatchMeta, add: bool) -> None:
    """y[t] (+)= x[t] @ w[slot(t)].T for the grouped tokens; x [T, K], w [S, N, K], y [T, N]."""
    num_segs, (n, k) = meta.seg_slots.shape[0], w.shape[1:]
    grid = (triton.cdiv(meta.max_seg_len, BLOCK_M), triton.cdiv(n, BLOCK_N), num_segs)
    _sgmv_kernel[grid](
        x,
        w,
        y,
        meta.token_order,
        meta.seg_starts,
        meta.seg_lens,
        meta.seg_slots,
        n,
        k,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        y.stride(0),
        ADD=add,
        IEEE=w.dtype == torch.float32,
        UPCAST=_INTERPRET,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )


def lora_shrink(x: Tensor, lora_a: Tensor, meta: LoRABatchMeta) -> Tensor:
    """x [T, in], lora_a [S, R, in] -> buf [T, R] fp32 (rows of base tokens left unwritten)."""
    buf = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    _launch(x.contiguous(), lora_a, buf, meta, add=False)
    return buf


def lora_expand(y: Tensor, buf: Tensor, lora_b: Tensor, meta: LoRABatchMeta) -> Tensor:
    """y [T, out] += buf [T, R] @ lora_b[slot].T [R, out], in place, for the grouped tokens."""
    _launch(buf, lora_b, y, meta, add=True)
    return y


def lora_apply_triton(
    y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoRABatchMeta
) -> Tensor:
    """The models/lora.py kernel signature: y += per-token adapter outputs (shrink, then expand)."""
    if not y.is_contiguous():
        y = y.contiguous()
    return lora_expand(y, lora_shrink(x, lora_a, meta), lora_b, meta)

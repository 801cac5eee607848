"""Triton weight-only matmul for int8 / int4 / fp8 weights in groups (models/quantization.py's formats).

y[M, N] = x[M, K] @ (q * d).T (+ bias): weights stay quantized in memory (int8: q as int8
[N, K]; int4: two values per byte [N, K / 2], u = q + 8, even k in the low nibble: models/quantization's
`pack_int4`; fp8: float8_e4m3fn [N, K]) with one fp16
scale per row and group of G inputs. Each program multiplies a [BM, G] tile of x by a [BN, G]
tile of q converted to x's dtype (integers up to 127 and e4m3 values are exact in bf16 / fp16) with fp32
accumulation, then scales the group's partial product by d in fp32: no activation rounding, the
same numerics as dequantizing to fp32 and multiplying (up to summation order).

For CUDA (CUDA graphs see one opaque custom op, `kvserve::triton_quant_linear`); under
TRITON_INTERPRET=1 it runs on the CPU, which is how tests/test_triton_quant.py checks it.
Not measured on a GPU yet (docs/quantization.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvserve.models.kernels import fix_interpreter_scalar_index

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

fix_interpreter_scalar_index()  # the group loop's runtime bound, under TRITON_INTERPRET=1


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)  # [BM]
    cols = pid_n * BN + tl.arange(0, BN)  # [BN]
    row_ok, col_ok = rows < M, cols < N
    kk = tl.arange(0, GROUP)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, K // GROUP):
        k0 = g * GROUP
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + kk)[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )  # [BM, G]
        if BITS == 8:
            # [BN, G] int8 or fp8 e4m3; rows past N (masked, no `other`: 0 does not cast to fp8) only
            # reach output columns that are never stored
            q = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + kk)[None, :],
                mask=col_ok[:, None],
            )
        else:
            half = tl.arange(0, GROUP // 2)
            b = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 // 2 + half)[None, :],
                mask=col_ok[:, None],
                other=0x88,
            )  # [BN, G / 2] uint8: padding columns read 0
            lo = (b & 15).to(tl.int8) - 8
            hi = (b >> 4).to(tl.int8) - 8
            q = tl.reshape(tl.join(lo, hi), (BN, GROUP))  # even k low nibble, odd k high nibble
        wq = q.to(tl.float32).to(
            x.dtype
        )  # exact; via fp32 (the interpreter's int -> bf16 is wrong)
        if IEEE:  # fp32 activations: no TF32 rounding
            part = tl.dot(x, tl.trans(wq), input_precision="ieee", out_dtype=tl.float32)  # [BM, BN]
        else:
            part = tl.dot(x, tl.trans(wq), out_dtype=tl.float32)
        d = tl.load(s_ptr + cols.to(tl.int64) * stride_sn + g, mask=col_ok, other=0.0).to(
            tl.float32
        )  # [BN]
        acc += part * d[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
    y = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@torch.library.custom_op("kvserve::triton_quant_linear", mutates_args=())
def _quant_linear_op(
    x: Tensor, w: Tensor, scales: Tensor, bias: Tensor | None, bits: int, group: int
) -> Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm = 16 if m <= 16 else 64
    bn = 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _quant_linear_kernel[grid](
        x,
        w,
        scales,
        bias if bias is not None else scales,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        scales.stride(0),
        y.stride(0),
        GROUP=group,
        BITS=bits,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
    )
    return y


@_quant_linear_op.register_fake
def _(x: Tensor, w: Tensor, scales: Tensor, bias: Tensor | None, bits: int, group: int) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def quant_linear(
    x: Tensor, w: Tensor, scales: Tensor, bias: Tensor | None, bits: int, group: int
) -> Tensor:
    """x [M, K] @ the weight (`w`: int8 or float8_e4m3fn [N, K], or packed int4 [N, K / 2]; `scales` fp16
    [N, K / group])
    (+ bias, fp32 [N]) -> [M, N] in x's dtype. ValueError naming anything that does not fit."""
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"x must be [M, K] float32/bfloat16/float16, got {tuple(x.shape)} {x.dtype}"
        )
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    k = x.shape[1]
    want_k = k if bits == 8 else k // 2
    dtypes = (torch.int8, torch.float8_e4m3fn) if bits == 8 else (torch.uint8,)
    if w.dim() != 2 or w.shape[1] != want_k or w.dtype not in dtypes:
        raise ValueError(
            f"an {bits}-bit weight for {k} inputs must be {' or '.join(map(str, dtypes))} "
            f"[N, {want_k}], got {tuple(w.shape)} {w.dtype}"
        )
    if group < 16 or group & (group - 1) or k % group:
        raise ValueError(f"group {group} must be a power of two >= 16 dividing K={k}")
    if scales.shape != (w.shape[0], k // group) or scales.dtype != torch.float16:
        raise ValueError(
            f"scales must be float16 {(w.shape[0], k // group)}, got {tuple(scales.shape)} {scales.dtype}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    return _quant_linear_op(x, w.contiguous(), scales.contiguous(), bias, bits, group)

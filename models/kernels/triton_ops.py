"""Triton kernels for a decoder layer's small ops: rotary + K/V cache write, (add +) RMSNorm, SiLU * up.

Each public function checks its arguments (ValueError quoting the bad value) and calls a
`torch.library.custom_op` (`kvserve::triton_*`, with a fake implementation), so
`torch.compile` and CUDA graphs see one opaque op per call. The op names carry a
`triton_` prefix because models/csrc registers `kvserve::rms_norm` and
`kvserve::silu_and_mul` for the CPU.

Numerics follow Hugging Face (models/layers.py, models/fused_ops.py): loads are converted
to fp32, and results are rounded to the model dtype where HF rounds:
- RMSNorm: normalize in fp32, round to the model dtype, multiply by the weight and round
  again (fp32: one rounding); `residual + x` is rounded to the dtype before the norm.
- SiLU * up: silu(gate) in fp32 rounded to the dtype, then the product rounded again.
- Rotary: `x * cos + flip_halves(x) * sin` in fp32, rounded ONCE. HF computes it in the
  model dtype (each product and the sum rounded), so bf16 results differ from HF's: on
  random Llama-shaped input in about 1/4 of the elements, mostly by 1 ulp, by less than
  2 ulps of |x| in absolute terms (more ulps of the result only where the two products
  nearly cancel). The kernel's value is the more accurate one; fp32 agrees to rounding.
The reduction order of the RMS sum differs from torch's (fp32 rounding noise only).

The `compiled_*` functions are `torch.compile`d versions of the torch ops (models/fused_ops.py),
compiled lazily on first use, for benchmarks/bench_kernels.py to compare against the kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvserve.models.fused_ops import TORCH_OPS, FusedOps

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- kernels ----


@triton.jit
def _rotary_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    positions_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cs_stride_p,
    cs_stride_2,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    num_heads,
    num_kv_heads,
    block_size,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):
    """One program per (token, block of HEAD_BLOCK heads): the q heads of the block, and the
    k/v heads of the block (masked past num_kv_heads). Halves are loaded separately, so
    head_dim only needs HALF_PAD = next_pow2(head_dim // 2) lanes."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)  # [HB]
    d = tl.arange(0, HALF_PAD)  # [HP]
    d_ok = d < HALF
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cs = cos_sin_ptr + pos * cs_stride_p
    cos1 = tl.load(cs + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cs + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(cs + cs_stride_2 + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]  # -sin
    sin2 = tl.load(cs + cs_stride_2 + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]

    q_mask = (heads < num_heads)[:, None] & d_ok[None, :]
    q_at = q_ptr + t * q_stride_t + heads[:, None] * q_stride_h + d[None, :]
    q1 = tl.load(q_at, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_at, (q1 * cos1 + q2 * sin1).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_at + HALF, (q2 * cos2 + q1 * sin2).to(q_ptr.dtype.element_ty), mask=q_mask)

    kv_mask = (heads < num_kv_heads)[:, None] & d_ok[None, :]
    k_at = k_ptr + t * k_stride_t + heads[:, None] * k_stride_h + d[None, :]
    k1 = tl.load(k_at, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_at + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k1_out = (k1 * cos1 + k2 * sin1).to(k_ptr.dtype.element_ty)
    k2_out = (k2 * cos2 + k1 * sin2).to(k_ptr.dtype.element_ty)
    tl.store(k_at, k1_out, mask=kv_mask)
    tl.store(k_at + HALF, k2_out, mask=kv_mask)

    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    cache_mask = kv_mask & (slot >= 0)  # slot -1: a padding row, nothing is written
    block, offset = slot // block_size, slot % block_size
    kc_at = (
        k_cache_ptr
        + block * kc_stride_b
        + offset * kc_stride_s
        + heads[:, None] * kc_stride_h
        + d[None, :]
    )
    tl.store(kc_at, k1_out.to(k_cache_ptr.dtype.element_ty), mask=cache_mask)
    tl.store(kc_at + HALF, k2_out.to(k_cache_ptr.dtype.element_ty), mask=cache_mask)
    v_at = v_ptr + t * v_stride_t + heads[:, None] * v_stride_h + d[None, :]
    vc_at = (
        v_cache_ptr
        + block * vc_stride_b
        + offset * vc_stride_s
        + heads[:, None] * vc_stride_h
        + d[None, :]
    )
    v1 = tl.load(v_at, mask=cache_mask, other=0.0)
    v2 = tl.load(v_at + HALF, mask=cache_mask, other=0.0)
    tl.store(vc_at, v1.to(v_cache_ptr.dtype.element_ty), mask=cache_mask)
    tl.store(vc_at + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=cache_mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row; the whole row in registers (BLOCK = next_pow2(num_cols))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_at = residual_ptr + row * residual_stride + cols
        total = (x + tl.load(residual_at, mask=mask, other=0.0).to(tl.float32)).to(
            residual_ptr.dtype.element_ty
        )
        tl.store(residual_at, total, mask=mask)
        x = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    y = x * rstd
    if ROUND_BEFORE_WEIGHT:  # HF: hidden.to(input_dtype), then weight * hidden
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, num_cols, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(num_cols, BLOCK)): out[r, c] = silu(x[r, c]) * x[r, num_cols + c]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    x_at = x_ptr + row * x_stride + cols
    gate = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_at + num_cols, mask=mask, other=0.0).to(tl.float32)
    act = (
        (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    )  # HF rounds silu's output
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers (custom ops) ----


@torch.library.custom_op(
    "kvserve::triton_rotary_and_cache_write", mutates_args=("q", "k", "k_cache", "v_cache")
)
def _rotary_and_cache_write_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    half_pad = triton.next_power_of_2(head_dim // 2)
    head_block = min(triton.next_power_of_2(num_heads), max(1, 1024 // half_pad))
    grid = (num_tokens, triton.cdiv(max(num_heads, num_kv_heads), head_block))
    _rotary_cache_kernel[grid](
        q,
        k,
        v,
        cos_sin_cache,
        positions,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        num_kv_heads,
        k_cache.shape[1],
        HALF=head_dim // 2,
        HALF_PAD=half_pad,
        HEAD_BLOCK=head_block,
        num_warps=4,
    )


@_rotary_and_cache_write_op.register_fake
def _(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping) -> None:
    return None


def _norm_launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    num_rows, num_cols = x.shape
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(num_cols)
    _rms_norm_kernel[(num_rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        num_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    return out


@torch.library.custom_op("kvserve::triton_rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _norm_launch(x, None, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("kvserve::triton_fused_add_rms_norm", mutates_args=("residual",))
def _fused_add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _norm_launch(x, residual, weight, eps)


@_fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("kvserve::triton_silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: Tensor) -> Tensor:
    num_rows, num_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    block = min(triton.next_power_of_2(num_cols), 1024)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(num_cols, block))](
        x, out, x.stride(0), out.stride(0), num_cols, BLOCK=block, num_warps=4
    )
    return out


@_silu_and_mul_op.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


# ---- public API ----


def rotary_and_cache_write(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    """Rotate q and k in place (neox style) and write the rotated k, and v, into the paged cache.

    q [T, H, D], k/v [T, KvH, D] (any token/head strides, e.g. views into one packed qkv
    row; last dim contiguous); cos_sin_cache [max_pos, 2, D] as `RotaryEmbedding` builds
    it; positions [T] int; k_cache/v_cache [num_blocks, block_size, KvH, D]; slot_mapping
    [T] int flat slots (block * block_size + offset), -1 = padding row: rotated, not written.
    """
    _check_rotary_args(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping)
    _rotary_and_cache_write_op(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: [..., hidden] -> new [..., hidden] (HF numerics, see the module doc)."""
    x2 = _rows(x, weight, "x")
    return _rms_norm_op(x2, weight, eps).view(x.shape)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """residual <- residual + x (rounded to the dtype, IN PLACE); returns (rms_norm(residual), residual)."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} "
            "must have the same shape and dtype"
        )
    x2, residual2 = _rows(x, weight, "x"), _rows(residual, weight, "residual")
    if residual2.data_ptr() != residual.data_ptr():
        raise ValueError(
            f"residual must be viewable as [rows, hidden] to be updated in place, strides "
            f"{residual.stride()}"
        )
    return _fused_add_rms_norm_op(x2, residual2, weight, eps).view(x.shape), residual


def silu_and_mul(x: Tensor) -> Tensor:
    """[T, 2 * I] -> new [T, I] = silu(x[:, :I]) * x[:, I:] (rows may be strided)."""
    if x.dim() != 2 or x.shape[1] % 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"silu_and_mul takes [T, 2 * I] float32/bfloat16/float16, got {tuple(x.shape)} {x.dtype}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    return _silu_and_mul_op(x)


# ---- as the model's FusedOps ----


class TritonFusedOps(FusedOps):
    """The kernels above: one launch each (rows the kernels cannot take use the torch ops)."""

    name = "triton"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dim() != 2 or x.stride(-1) != 1:  # e.g. Qwen3's per-head q/k norm on strided views
            return super().rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        return fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return silu_and_mul(x)


# ---- torch.compile'd alternatives (compared with the kernels in docs/performance.md) ----


@functools.cache
def _compiled(name: str) -> Callable:
    return torch.compile(getattr(TORCH_OPS, name), dynamic=True)


def compiled_fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """`FusedOps.add_rms_norm` under torch.compile: returns a new residual (not in place)."""
    return _compiled("add_rms_norm")(x, residual, weight, eps)


def compiled_silu_and_mul(x: Tensor) -> Tensor:
    return _compiled("silu_and_mul")(x)


# ---- argument checks ----


def _rows(x: Tensor, weight: Tensor, name: str) -> Tensor:
    """x [..., hidden] as [rows, hidden] with a contiguous last dim (a view where possible)."""
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{name} {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"{name} and weight must share one of {SUPPORTED_DTYPES}, got {x.dtype} and {weight.dtype}"
        )
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def _check_rotary_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    if (
        q.dim() != 3
        or k.dim() != 3
        or v.shape != k.shape
        or q.shape[0] != k.shape[0]
        or q.shape[2] != k.shape[2]
    ):
        raise ValueError(
            f"expected q [T, H, D], k and v [T, KvH, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    if cos_sin_cache.dim() != 3 or tuple(cos_sin_cache.shape[1:]) != (2, head_dim):
        raise ValueError(
            f"cos_sin_cache must be [max_pos, 2, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    cache_shape = (k.shape[1], head_dim)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != cache_shape:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {cache_shape[0]}, {head_dim}], "
                f"got {tuple(cache.shape)}"
            )
    if tuple(positions.shape) != (num_tokens,) or tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
            f"must be [{num_tokens}]"
        )
    if positions.is_floating_point() or slot_mapping.is_floating_point():
        raise ValueError(
            f"positions and slot_mapping must be integer, got {positions.dtype}, {slot_mapping.dtype}"
        )
    for name, t in (
        ("q", q),
        ("k", k),
        ("v", v),
        ("cos_sin_cache", cos_sin_cache),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous, strides {t.stride()}")
    if q.dtype != k.dtype or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q and k must share one of {SUPPORTED_DTYPES}, got {q.dtype} and {k.dtype}"
        )

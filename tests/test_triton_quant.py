"""models/kernels/triton_quant.py on the CPU under Triton's interpreter, against float64 references.

The kernel is weight-only: y = x @ (q * d).T (+ bias), accumulated in fp32 one group at a time,
so the reference is the dequantized matmul in float64 and the tolerance is fp32 summation plus
one rounding to the output dtype.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("triton")

from kvserve.models.kernels import triton_quant  # noqa: E402
from kvserve.models.quantization import (  # noqa: E402
    QuantizedLinear,
    QuantizedWeight,
    dequantize,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    triton_applies,
    unpack_int4,
)
from test_triton_attention import compile_for_sm90  # noqa: E402


def make_weight(
    n: int, k: int, bits: int, group: int, seed: int = 0, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return (quantize_fp8 if fp8 else quantize_int8 if bits == 8 else quantize_int4)(w, group)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
# bf16: the interpreter's tl.dot has no bf16 (numpy), so bf16 is checked by compiling for sm_90 below
# and on a GPU (.ci/gpu_session.sh); fp16 runs the same code path with the same conversions.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,group,bias",
    [
        (1, 64, 64, 32, False),
        (3, 100, 128, 32, True),
        (20, 70, 96, 32, True),
        (17, 130, 256, 64, False),
        (5, 16, 64, 16, True),
    ],
)
def test_matches_the_dequantized_matmul(fmt, dtype, m, n, k, group, bias):
    bits = 4 if fmt == "int4" else 8
    q, d = make_weight(n, k, bits, group, seed=m + n, fp8=fmt == "fp8")
    w = q if bits == 8 else pack_int4(q)
    b = torch.randn(n) if bias else None
    x = torch.randn(m, k).to(dtype)
    y = triton_quant.quant_linear(x, w, d, b, bits, group)
    want = x.double() @ dequantize(q, d, group).double().T + (b.double() if bias else 0)
    assert y.shape == (m, n) and y.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2**-10}[dtype]
    assert ((y.double() - want).abs() <= tol * want.abs().max() + 1e-6).all()


def test_int4_nibbles_round_trip():
    q, _ = make_weight(33, 64, 4, 32)
    packed = pack_int4(q)
    assert packed.shape == (33, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


def test_empty_batch_and_strided_rows():
    q, d = make_weight(64, 64, 8, 32)
    assert triton_quant.quant_linear(torch.zeros(0, 64), q, d, None, 8, 32).shape == (0, 64)
    wide = torch.randn(4, 96)
    x = wide[:, 16:80]  # rows 96 apart
    want = triton_quant.quant_linear(x.contiguous(), q, d, None, 8, 32)
    assert torch.equal(triton_quant.quant_linear(x, q, d, None, 8, 32), want)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=3), "bits must be 8 or 4"),
        (dict(group=48), "power of two"),
        (dict(x=torch.zeros(2, 32)), "8-bit weight for 32 inputs"),
        (dict(scales=torch.zeros(64, 2)), "scales must be float16"),
        (dict(x=torch.zeros(2, 64, dtype=torch.int32)), "x must be"),
    ],
)
def test_bad_arguments_raise_value_errors(kwargs, match):
    q, d = make_weight(64, 64, 8, 32)
    args = dict(x=torch.zeros(2, 64), w=q, scales=d, bias=None, bits=8, group=32) | kwargs
    with pytest.raises(ValueError, match=match):
        triton_quant.quant_linear(**args)


def test_plain_int4_weights_are_two_to_a_byte_and_take_the_triton_path():
    """What a CUDA model holds (the portable layout): int4 in nibbles, a quarter of bf16's bytes;
    the layout the Triton kernel reads. Group sizes it cannot tile stay on the portable path."""
    w = torch.randn(64, 128) * 0.05
    int4 = QuantizedWeight.quantize(w, 4, 32, packed=False)
    assert int4.nibbles and int4.data.shape == (64, 64) and triton_applies(int4)
    assert int4.nbytes == 64 * 64 + 64 * 4 * 2
    q, d = quantize_int4(w, 32)
    assert torch.equal(int4.unpack()[0], q) and torch.equal(int4.unpack()[1], d)
    lin = QuantizedLinear(int4, None)
    x = torch.randn(3, 128)
    portable = x @ dequantize(q, d, 32).T
    assert torch.allclose(lin(x), portable, atol=1e-5)  # CPU tensors: the portable path
    assert not triton_applies(QuantizedWeight.quantize(torch.randn(8, 96), 8, 48, packed=False))


def test_fp8_weights_are_plain_e4m3_and_take_the_triton_path():
    """fp8: one byte per weight (e4m3) plus an fp16 scale per group; max|w| of each group maps to 448."""
    w = torch.randn(64, 128) * 0.05
    w[3, :32] = 0  # an all-zero group: scale 0, values 0
    fp8 = QuantizedWeight.quantize(w, 8, 32, packed=False, fp8=True)
    assert (
        fp8.fp8 and not fp8.packed and fp8.data.dtype == torch.float8_e4m3fn and triton_applies(fp8)
    )
    assert fp8.nbytes == 64 * 128 + 64 * 4 * 2
    q, d = fp8.unpack()
    assert q.float()[3, :32].eq(0).all() and d[3, 0] == 0
    assert q.float().abs().amax(-1).le(448).all() and torch.isfinite(q.float()).all()
    w_hat = dequantize(q, d, 32)
    assert (
        (w_hat - w).abs() <= 2**-4 * w.abs() + 2**-9 * d.float().repeat_interleave(32, -1)
    ).all()
    lin = QuantizedLinear(fp8, None)
    x = torch.randn(3, 128)
    assert torch.allclose(lin(x), x @ w_hat.T, atol=1e-5)  # CPU tensors: the portable path
    assert torch.equal(fp8.rows(torch.tensor([3, 5]), torch.float32), w_hat[[3, 5]])


_COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.models.kernels import triton_quant as tq

fn = tq._quant_linear_kernel
for t in ("bf16", "fp16", "fp32"):
    for w_type in ("i8", "u8", "fp8e4nv"):  # int8, int4 in nibbles, fp8 e4m3
        for bm in (16, 64):
            consts = dict(GROUP=32, BITS=4 if w_type == "u8" else 8, HAS_BIAS=True, IEEE=t == "fp32", BM=bm, BN=64)
            types = dict(x_ptr="*" + t, w_ptr="*" + w_type, s_ptr="*fp16", b_ptr="*fp32", y_ptr="*" + t)
            sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
            triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4, num_stages=3))
print("compiled")
"""


def test_kernel_compiles_for_h100():
    """The interpreter skips Triton's compiler (and bf16): compile every variant for sm_90, no GPU needed."""
    compile_for_sm90(_COMPILE_FOR_SM90)

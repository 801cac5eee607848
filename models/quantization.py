"""Weight quantization: int8 and int4 in groups along the input features, applied at load.

The formats are llama.cpp's Q8_0 and Q4_0 with any group size (32 by default, theirs):
per output row and group of G input features, one fp16 scale d and G integers q, w = q * d;
int8: d = amax / 127, q = round(w / d) (half away from zero); int4: d = m / -8 with m the
group's value of largest magnitude, q = trunc(w / d + 8.5) - 8, clipped to [-8, 7].
`quantize_int8` / `quantize_int4` give the gguf package's blocks bit for bit, so quantizing
the exact values of a Q8_0 or Q4_0 file gives back that file's blocks.

Each `Linear` is quantized once its weight is loaded (`Quantizer`, models/quantizer.py);
`QuantizedLinear` replaces its matmul. With a CPU kernel set loaded (models/cpu_ops: AVX-512
VNNI, AVX2, NEON) the weight is packed for
`cpu_ops.quant_linear`, which also quantizes the activations per row and group
(as llama.cpp does) and multiplies in int8 (`reference_linear` is its exact definition in
float64). Elsewhere the weight stays plain ([N, K] int8, or int4 two to a byte): on CUDA the
Triton weight-only kernel multiplies it (models/kernels/triton_quant.py); otherwise, and as the
portable reference, each call dequantizes it for `F.linear` (weight-only; slow, a fallback).
The LM head is int8 under both schemes (llama.cpp keeps it at 6 bits or more too); a tied
embedding reads its rows from the quantized head; an untied input embedding stays in the
model dtype.

fp8 (for GPUs) is the same shape of format with float8_e4m3fn values: per row and group one fp16
scale d = max|w| / 448 and w = q * d (`quantize_fp8`); every matrix, the LM head included, is
fp8. It is always plain and weight-only: the Triton kernel on CUDA, the portable path elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.models import cpu_ops
from kvserve.models.backends import DEFAULT_GROUP_SIZE

_OFFSET = {8: 128, 4: 8}  # the unsigned storage: u = q + offset
_STEP_BYTES = {8: 256, 4: 128}  # packed bytes per 64 columns and 4 inputs


# ---- the formats ------------------------------------------------------------------------------------


def _groups(w: Tensor, group: int) -> Tensor:
    n, k = w.shape
    if k % group:
        raise ValueError(
            f"a [{n}, {k}] weight does not split into groups of {group} input features"
        )
    return w.float().reshape(n, k // group, group)


def _roundf(x: Tensor) -> Tensor:
    """C's roundf (half away from zero, what ggml's reference quantizer uses) of fp32 values, in
    fp32. Not trunc(x + 0.5 sign(x)): that sum rounds 0.49999997 up to 1. The fraction x - trunc(x)
    is exact in fp32, so comparing it with 0.5 decides the tie and the step exactly."""
    t = x.trunc()
    step = (x - t).abs_().ge_(0.5).to(x.dtype)  # 1 where |fraction| >= 0.5
    return t.add_(step.copysign_(x))


def quantize_int8(w: Tensor, group: int = DEFAULT_GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """[N, K] -> (q int8 [N, K], d float16 [N, K / group]): Q8_0's rule."""
    blocks = _groups(w, group)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = _roundf(blocks * inv).to(torch.int8)
    return q.reshape(w.shape), d.squeeze(-1).to(torch.float16)


def quantize_int4(w: Tensor, group: int = DEFAULT_GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """[N, K] -> (q int8 in [-8, 7] [N, K], d float16 [N, K / group]): Q4_0's rule."""
    blocks = _groups(w, group)
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = extreme / -8
    inv = torch.where(d == 0, 0.0, 1 / d)
    u = (blocks * inv + 8.5).trunc().clamp(0, 15)
    return (u - 8).to(torch.int8).reshape(w.shape), d.squeeze(-1).to(torch.float16)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (it has no infinity: past it is NaN)


def quantize_fp8(w: Tensor, group: int = DEFAULT_GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """[N, K] -> (q float8_e4m3fn [N, K], d float16 [N, K / group]): d = max|w| / 448 per group, q = w / d
    rounded to the nearest fp8 value (the division by the fp16-rounded d, clamped into range)."""
    blocks = _groups(w, group)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / FP8_MAX).to(torch.float16)
    inv = torch.where(d == 0, 0.0, 1 / d.float())
    q = (blocks * inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), d.squeeze(-1)


def dequantize(q: Tensor, d: Tensor, group: int) -> Tensor:
    """(q [N, K], d [N, K / group]) -> fp32 [N, K], w = q * d exactly."""
    return (q.float().unflatten(-1, (-1, group)) * d.float()[..., None]).flatten(-2)


@dataclass
class QuantizedWeight:
    """One quantized [n, k] matrix. `packed`: the kernel layout (uint8 [ceil(n/64), k/4, 256 or
    128] and fp16 scales [ceil(n/64), k/group, 64]); else plain (int8 q [n, k], fp16 d [n, k/group]).
    `fp8`: q is float8_e4m3fn (bits 8, always plain: no CPU kernel multiplies it)."""

    bits: int
    group: int
    n: int
    k: int
    data: Tensor
    scales: Tensor
    packed: bool
    nibbles: bool = False  # plain int4 two to a byte ([n, k / 2], `pack_int4`), not one int8 each
    fp8: bool = False

    @classmethod
    def quantize(
        cls, w: Tensor, bits: int, group: int, packed: bool, fp8: bool = False
    ) -> QuantizedWeight:
        if fp8:
            q, d = quantize_fp8(w, group)
            return cls(
                8, group, q.shape[0], q.shape[1], q.contiguous(), d.contiguous(), False, fp8=True
            )
        q, d = (quantize_int8 if bits == 8 else quantize_int4)(w, group)
        return cls.from_int(q, d, bits, group, packed)

    @classmethod
    def from_int(cls, q: Tensor, d: Tensor, bits: int, group: int, packed: bool) -> QuantizedWeight:
        n, k = q.shape
        if not packed:  # int4 two to a byte: a quarter of bf16's memory here too
            if bits == 4 and k % 2 == 0:
                return cls(bits, group, n, k, pack_int4(q), d.contiguous(), False, nibbles=True)
            return cls(bits, group, n, k, q.contiguous(), d.contiguous(), False)
        blocks = -(-n // 64)
        u = torch.zeros(
            blocks * 64, k, dtype=torch.uint8
        )  # padding rows: weight 0 (their scales are 0)
        u[:n] = q.view(torch.uint8) + _OFFSET[bits]  # q + offset, in uint8 arithmetic (mod 256)
        u = u.view(blocks, 64, k // 4, 4).permute(
            0, 2, 1, 3
        )  # [blocks, steps, 64 columns, 4 inputs]
        if bits == 4:  # vectors of 16 columns: 0 | 1 << 4, then 2 | 3 << 4
            v = u.reshape(blocks, k // 4, 2, 2, 64)
            u = v[:, :, :, 0] | (v[:, :, :, 1] << 4)
        data = u.reshape(blocks, k // 4, _STEP_BYTES[bits]).contiguous()
        s = torch.zeros(blocks * 64, k // group, dtype=torch.float16)
        s[:n] = d
        scales = s.view(blocks, 64, k // group).permute(0, 2, 1).contiguous()
        return cls(bits, group, n, k, data, scales, True)

    def to(self, device: torch.device) -> QuantizedWeight:
        """This weight on `device` (itself when already there)."""
        if self.data.device == device:
            return self
        return replace(self, data=self.data.to(device), scales=self.scales.to(device))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes

    def unpack_rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(q int8 (fp8: float8_e4m3fn) [T, k], d float16 [T, k / group]) of rows `ids`."""
        if not self.packed:
            return self.q_rows(ids), self.scales[ids]
        q, d = self._packed_rows(ids)
        return torch.from_numpy(q), torch.from_numpy(d)

    def _packed_rows(self, ids: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """`unpack_rows` of the packed (CPU) layout, in numpy: a decode step's embedding lookup
        is one row, and numpy's indexing costs a small fraction of torch's per call."""
        ids_np = ids.numpy()
        block, col = ids_np // 64, ids_np % 64
        d = self.scales.numpy()[block, :, col]  # [T, groups]
        if self.bits == 8:
            u = self.data.numpy().reshape(-1, self.k // 4, 64, 4)[block, :, col]  # [T, steps, 4]
        else:
            vec = col // 16
            half, shift = vec // 2, (vec % 2) * 4
            byte = 4 * (col % 16)[:, None] + np.arange(4)
            v = self.data.numpy().reshape(-1, self.k // 4, 2, 64)[
                block[:, None], :, half[:, None], byte
            ]  # [T, 4, steps]
            u = (v.swapaxes(1, 2) >> shift[:, None, None].astype(np.uint8)) & 15
        q = (u.reshape(len(ids_np), self.k).astype(np.int16) - _OFFSET[self.bits]).astype(np.int8)
        return q, d

    def q_rows(self, ids: Tensor) -> Tensor:
        """q of rows `ids` (plain layouts)."""
        return unpack_int4(self.data[ids]) if self.nibbles else self.data[ids]

    def full_q(self) -> Tensor:
        """q [n, k] (plain layouts)."""
        return unpack_int4(self.data) if self.nibbles else self.data

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Dequantized rows `ids` [T] -> [T, k] (an embedding lookup from the quantized matrix)."""
        if self.packed:  # as `dequantize`, in numpy (fp32 products, exact either way)
            q, d = self._packed_rows(ids)
            w = (
                q.reshape(len(q), self.k // self.group, self.group).astype(np.float32)
                * d.astype(np.float32)[..., None]
            )
            return torch.from_numpy(w.reshape(len(q), self.k)).to(dtype)
        q, d = self.unpack_rows(ids)
        return dequantize(q, d, self.group).to(dtype)

    def unpack(self) -> tuple[Tensor, Tensor]:
        """(q [n, k] as `unpack_rows`, d float16 [n, k / group]) of the whole matrix."""
        return self.unpack_rows(torch.arange(self.n, device=self.data.device))


# ---- the matmul ---------------------------------------------------------------------------------------


def quantize_activations(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """The kernel's activation rounding: x [M, K] -> (q [M, K] in [-127, 127] as fp32, d fp32 [M, K/group])."""
    blocks = x.float().unflatten(-1, (-1, group))
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    return torch.round(blocks * inv).flatten(-2), d.squeeze(
        -1
    )  # round: to nearest even, like vcvtps2dq


def reference_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """What `cpu_ops.quant_linear` computes, in float64: x [M, K] -> [M, N]."""
    qx, dx = quantize_activations(x, weight.group)
    qw, dw = weight.unpack()
    g = weight.group
    dots = torch.einsum(
        "mgi,ngi->mng", qx.double().unflatten(-1, (-1, g)), qw.double().unflatten(-1, (-1, g))
    )
    y = (dots * dx.double()[:, None, :] * dw.double()[None]).sum(-1)
    return y if bias is None else y + bias.double()


def triton_applies(weight: QuantizedWeight) -> bool:
    """Whether the Triton kernel takes this plain weight (a power-of-two group of 16 or more, int4
    two to a byte) and triton is installed."""
    if (
        weight.group < 16
        or weight.group & (weight.group - 1)
        or (weight.bits == 4 and not weight.nibbles)
    ):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pack_int4(q: Tensor) -> Tensor:
    """int8 q in [-8, 7] [N, K] (K even) -> uint8 [N, K / 2]: u = q + 8, even k in the low nibble."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of `pack_int4`: int8 [N, K]."""
    lo, hi = (packed & 15).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def has_kernels() -> bool:
    """True when models/cpu_ops' int8/int4 kernel runs here (every kernel set has it)."""
    return cpu_ops.has_fast_bf16()


class QuantizedLinear:
    """x @ W.T (+ bias) for a `QuantizedWeight`, chosen once: the C++ kernel for a packed weight;
    on CUDA the Triton weight-only kernel (models/kernels/triton_quant.py); else
    dequantize-and-F.linear (the portable path)."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None) -> None:
        self.weight, self.bias = (
            weight,
            None if bias is None else bias.detach().float().contiguous(),
        )
        self.triton = None
        if not weight.packed and weight.data.is_cuda and triton_applies(weight):
            from kvserve.models.kernels import triton_quant  # imports triton: only when chosen

            self.triton = triton_quant.quant_linear

    def __call__(self, x: Tensor) -> Tensor:
        w = self.weight
        if self.triton is not None:
            flat = x.reshape(-1, x.shape[-1])
            y = self.triton(flat, w.data, w.scales, self.bias, w.bits, w.group)
            return y.view(*x.shape[:-1], w.n)
        if not w.packed:
            full = dequantize(w.full_q(), w.scales, w.group).to(x.dtype)
            return F.linear(x, full, None if self.bias is None else self.bias.to(x.dtype))
        if (
            x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1
        ):  # the model's case: no reshapes
            return cpu_ops.quant_linear(x, w.data, w.scales, self.bias, w.n, w.bits, w.group)
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype not in (torch.bfloat16, torch.float32):  # fp16: the kernel reads bf16 or fp32
            flat = flat.float()
        elif flat.stride(-1) != 1:
            flat = flat.contiguous()
        y = cpu_ops.quant_linear(flat, w.data, w.scales, self.bias, w.n, w.bits, w.group).to(
            x.dtype
        )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], w.n)


def packed_matmuls(model: nn.Module) -> Iterator[Any]:
    """Every layer's packed matmul (`Linear.packed`, a tied head's `packed_lm_head`; stacked
    experts' one per expert): `QuantizedLinear`s, the bf16 kernels' and oneDNN's."""
    for m in model.modules():
        for attr in ("packed", "packed_lm_head"):
            fns = getattr(m, attr, None)
            yield from fns if isinstance(fns, list) else [] if fns is None else [fns]


# ---- what loading did ------------------------------------------------------------------------------


@dataclass
class QuantizationReport:
    """What loading did to the weights: their format and resident bytes (set once the model is packed)."""

    method: str
    group_size: int
    quantized_layers: int
    weight_bytes: int

    def describe(self) -> str:
        if self.method == "none":
            return f"weights unquantized, {self.weight_bytes / 2**20:.1f} MiB"
        head = "fp8" if self.method == "fp8" else "int8"
        return (
            f"weights {self.method} (groups of {self.group_size}, LM head {head}), {self.quantized_layers} "
            f"matrices quantized, {self.weight_bytes / 2**20:.1f} MiB"
        )

"""The small fused ops of a decoder layer, one implementation per device, chosen at load.

`RMSNorm` and the gated MLP call `self.ops.<op>`; the loader gives every module with
an `ops` attribute the model's `FusedOps` (`select_ops`). `FusedOps` itself is plain
PyTorch with Hugging Face's numerics, on any device; `models/cpu_model.py` has the C++
versions and `TritonFusedOps` below the CUDA ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class FusedOps:
    name = "torch"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """HF's numerics: normalize in fp32, round to the model dtype, then scale (rounding again).
        `F.rms_norm` on a bf16/fp16 input normalizes in fp32 and rounds once, like HF's
        `.to(input_dtype)`, so the weight stays outside it; in fp32 both are one op."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x, weight.shape, None, eps)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """(rms_norm(residual + x), residual + x), the sum rounded to the model dtype."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: Tensor) -> Tensor:  # [T, 2 * I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = FusedOps()


class TritonFusedOps(FusedOps):
    """models/kernels/triton_ops.py: one launch each (rows the kernels cannot take use the torch ops)."""

    name = "triton"

    def __init__(self) -> None:
        from models.kernels import triton_ops

        self.kernels = triton_ops

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dim() != 2 or x.stride(-1) != 1:  # e.g. Qwen3's per-head q/k norm on strided views
            return super().rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return self.kernels.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return self.kernels.silu_and_mul(x)


def select_ops(device: torch.device, dtype: torch.dtype, attention_backend: str) -> FusedOps:
    """The fused ops that go with the model's attention backend (Triton's also on the CPU, where
    only the interpreter runs them: the tests)."""
    if attention_backend == "triton":
        return TritonFusedOps()
    if device.type == "cpu":
        from models.cpu_model import CpuFusedOps

        return CpuFusedOps()
    return TORCH_OPS


def bind_ops(model: torch.nn.Module, ops: FusedOps) -> None:
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops

"""The small fused ops of a decoder layer, one implementation per device, chosen at load.

`RMSNorm` and the gated MLP call `self.ops.<op>`; the loader gives every module with
an `ops` attribute the model's `FusedOps` (`select_ops`). `FusedOps` itself is plain
PyTorch with Hugging Face's numerics, on any device; `models/cpu_model.py` has the C++
versions and `models/kernels/triton_ops.py` the Triton ones (CUDA).
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

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """(rms_norm(residual + x), residual + x), the sum rounded to the model dtype."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: Tensor) -> Tensor:  # [T, 2 * I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rms_norm_heads_(self, heads: Tensor, weight: Tensor, eps: float) -> None:
        """`rms_norm` of each head of heads [T, H, D] (a view into qkv), written back in place."""
        heads.copy_(self.rms_norm(heads, weight, eps))


TORCH_OPS = FusedOps()

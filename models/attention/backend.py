"""The interface every attention backend implements, and the choice of one at load.

A backend owns everything device-specific about one attention layer's step: how the
new tokens' q/k get their rotary embedding, how K/V reach the paged cache, and which
kernels attend. The loader picks one backend per model (`select_backend`) and gives
it to every `Attention` layer; model files never branch on the device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from models.attention.layer import Attention

BACKENDS = ("auto", "torch", "cpu", "triton")


class AttentionBackend:
    name = "base"
    index_dtype = torch.int64  # of the metadata's slot_mapping / block_table / seq_lens / cu_seqlens_q
    supports_cuda_graphs = False  # its decode path depends on no host value that changes between steps

    def forward(self, layer: Attention, qkv: Tensor) -> Tensor:
        """qkv [T, (H + 2 KvH) * D] (rows may be strided) -> [T, H * D]: rotary on q and k,
        the new K/V into the layer's cache, then causal attention over the cache."""
        raise NotImplementedError


def select_backend(name: str, device: torch.device, dtype: torch.dtype, head_dims: set[int]) -> AttentionBackend:
    """The backend called `name` ('auto': the device's best) for a model on `device`; ValueError
    naming the reason when it cannot run there."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "cpu" if device.type == "cpu" else "triton" if _triton_available() else "torch"
    if name == "torch":
        from models.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' needs device cpu, got {device}")
        from models.attention.cpu import CpuAttentionBackend

        return CpuAttentionBackend(dtype, head_dims)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1), got {device}")
    if not _triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    from models.attention.triton import TritonAttentionBackend

    return TritonAttentionBackend()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

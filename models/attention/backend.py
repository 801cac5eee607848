"""The attention-backend registry: the choice of one backend at load.

The loader picks one backend per model (`select_backend`) and gives it to every
`Attention` layer; model files never branch on the device. The interface the backends
implement is `AttentionBackend` in models/attention/layer.py. This registry imports the
backends (and they import the layer), so it is the one place allowed to close an import
cycle (tests/test_import_graph.py).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch

from kvserve.models.backends import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from kvserve.models.attention.layer import AttentionBackend

BACKENDS = ATTENTION_BACKENDS


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype, head_dims: set[int]
) -> AttentionBackend:
    """The backend called `name` ('auto': the device's best) for a model on `device`; ValueError
    naming the reason when it cannot run there."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "cpu" if device.type == "cpu" else "triton" if _triton_available() else "torch"
    if name == "torch":
        return reference_backend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' needs device cpu, got {device}")
        from kvserve.models.attention.cpu import CpuAttentionBackend

        return CpuAttentionBackend(dtype, head_dims)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1), got {device}"
        )
    if not _triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    from kvserve.models.attention.triton import TritonAttentionBackend

    return TritonAttentionBackend()


@functools.cache
def reference_backend() -> AttentionBackend:
    """The portable PyTorch backend: what a layer uses until the loader sets the device's."""
    from kvserve.models.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

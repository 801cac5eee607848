"""Paged attention: the step's metadata, the `Attention` layer, and one backend per device.

models/attention/metadata.py   AttentionMetadata + forward_context (one per step)
models/attention/layer.py      Attention: qkv -> rotary -> K/V into the cache -> attention,
                               and the AttentionBackend interface
models/attention/backend.py    the registry: `select_backend` (once, at load)
models/attention/torch_ref.py  portable PyTorch (any device; the tests' oracle)
models/attention/cpu.py        models/cpu_ops' C++ kernels
models/attention/triton.py     Triton kernels (CUDA), CUDA-graph safe for decode steps
"""

from kvserve.models.attention.backend import BACKENDS, select_backend
from kvserve.models.attention.layer import Attention, AttentionBackend
from kvserve.models.attention.metadata import (
    AttentionMetadata,
    forward_context,
    get_forward_context,
)

__all__ = [
    "BACKENDS",
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "forward_context",
    "get_forward_context",
    "select_backend",
]

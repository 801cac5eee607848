"""A Q8_0 / Q4_0 GGUF matrix read as its blocks, handed to the quantizer as they stand.

Served as int8 / int4 in groups of 32, such a matrix's quantized weight is the file's blocks
themselves: per row and block of 32 input features one fp16 scale d and 32 integers q (Q8_0: int8;
Q4_0: nibbles u, q = u - 8), w = q * d. Reading them straight from the file skips dequantizing to
fp32 and quantizing again, and holds exactly the blocks llama.cpp computes with. A parameter
takes blocks only when every tensor filling it is of the kind it is held at
(models/gguf_loader.direct_tensors); any other (a K-quant beside it, another group size or bit
width, GPT-2's transposed matrices, `--quantization none`) is dequantized as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvserve.models.gguf_metadata import import_gguf

BLOCK_SIZE = 32  # Q8_0's and Q4_0's block: the quantizer's group
_BLOCK_BITS = {"Q8_0": 8, "Q4_0": 4}


@dataclass(frozen=True, slots=True)
class QuantBlocks:
    """A matrix (or stacked matrices) as its blocks: q int8 [..., out, in] (Q4_0: in [-8, 7]) and
    d float16 [..., out, in / 32]. Row operations apply to both alike (`apply`)."""

    q: Tensor
    d: Tensor
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, i: int) -> QuantBlocks:  # one expert of stacked experts
        return QuantBlocks(self.q[i], self.d[i], self.bits)

    def apply(self, fn: Callable[[Tensor], Tensor]) -> QuantBlocks:
        """The blocks with the same row operation (e.g. a row permutation) on q and d."""
        return QuantBlocks(fn(self.q), fn(self.d), self.bits)


def block_bits(t) -> int | None:
    """8 for a Q8_0 reader tensor, 4 for Q4_0, else None."""
    gguf = import_gguf()
    return _BLOCK_BITS.get(gguf.GGMLQuantizationType(t.tensor_type).name)


def read_blocks(t) -> QuantBlocks:
    """A Q8_0 / Q4_0 reader tensor's blocks, in PyTorch's dimension order (no float arithmetic)."""
    bits = block_bits(t)
    if bits is None:
        raise ValueError(f"GGUF tensor {t.name!r} is not Q8_0 or Q4_0")
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
    # [rows * blocks, 2 + 32] (Q8_0) or [rows * blocks, 2 + 16] (Q4_0) bytes
    raw = np.asarray(t.data).reshape(-1, 2 + BLOCK_SIZE * bits // 8)
    d = np.ascontiguousarray(raw[:, :2]).view(np.float16)  # [rows * blocks, 1]
    if bits == 8:
        q = np.ascontiguousarray(raw[:, 2:]).view(np.int8)
    else:  # element i in the low nibble of byte i, element 16 + i in its high nibble
        q = np.empty((len(raw), BLOCK_SIZE), np.int8)
        np.bitwise_and(raw[:, 2:], 15, out=q[:, :16], casting="unsafe")
        np.right_shift(raw[:, 2:], 4, out=q[:, 16:], casting="unsafe")
        q -= 8
    return QuantBlocks(
        torch.from_numpy(q).reshape(shape),
        torch.from_numpy(d).reshape(*shape[:-1], shape[-1] // BLOCK_SIZE),
        bits,
    )

"""Quantizing a model's weights as they load: which matrices, in which format, and when.

`Quantizer` turns each `Linear` into a `QuantizedLinear` (models/quantization.py) as soon as its
weight is loaded, from the checkpoint's float values or, for a GGUF file's Q8_0 / Q4_0 matrices,
from the file's blocks as they stand (`stage_blocks`, models/gguf_blocks.py).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from kvserve.models.backends import check_quantization
from kvserve.models.gguf_blocks import BLOCK_SIZE
from kvserve.models.quantization import (
    QuantizationReport,
    QuantizedLinear,
    QuantizedWeight,
    has_kernels,
    packed_matmuls,
)

logger = logging.getLogger(__name__)


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from kvserve.models.layers import Linear

    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]


def _is_lm_head(name: str) -> bool:
    return name == "lm_head" or name.endswith(".lm_head")


def check_quantizable(model: nn.Module, group: int) -> None:
    """ValueError naming the first matrix whose input features do not split into groups (before any
    weight is read, so nothing is half-loaded)."""
    check_quantization(None, group)
    for name, m in _linears(model):
        if m.in_features % group:
            raise ValueError(
                f"cannot quantize {name} in groups of {group}: it has {m.in_features} input "
                f"features (not a multiple of {group}); choose another --quantization-group-size"
            )


def mark_for_staging(model: nn.Module) -> None:
    """Load the weights that will be quantized in fp32 (the checkpoint's values, exactly) on the
    CPU: there an unwritten allocation costs nothing, so only the matrix being quantized is ever
    resident (a GPU would allocate every staged matrix up front)."""
    weights = [m.weight for _, m in _linears(model)]
    emb = _tied_embedding(model)
    for w in weights + ([emb.weight] if emb is not None else []):
        w.stage_dtype, w.stage_device = torch.float32, torch.device("cpu")


def _tied_embedding(model: nn.Module) -> nn.Module | None:
    """The token embedding that is also the LM head, if the model ties them."""
    from kvserve.models.layers import VocabEmbedding

    if not getattr(model, "tie_word_embeddings", False):
        return None
    vocab_size = model.config.vocab_size  # the token embedding, not e.g. GPT-2's positions
    return next(
        (
            emb
            for emb in model.modules()
            if isinstance(emb, VocabEmbedding)
            and getattr(emb, "vocab_size", emb.weight.shape[0]) == vocab_size
        ),
        None,
    )


class Quantizer:
    """Quantizes a model's matrices as the loader completes them (`loaded(name)`), so at most one
    float matrix is resident beside the quantized ones, then the rest in `finish()`: every
    `Linear` gets a `QuantizedLinear` (`method` int8, int4 or fp8; the LM head and `eight_bit`'s
    matrices int8, or fp8 under fp8) and a tied embedding that 8-bit form (rows looked up in
    `dtype`, the model's). Float weights are freed."""

    def __init__(
        self,
        model: nn.Module,
        method: str,
        group: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        eight_bit: frozenset[str] = frozenset(),
    ) -> None:
        self.model, self.method, self.group, self.dtype = model, method, group, dtype
        self.eight_bit = (
            eight_bit  # parameter names held int8 under int4 (a GGUF file's wider matrices)
        )
        self.device = torch.device(
            device
        )  # where the quantized weights go (staged ones are on the CPU)
        self.fp8 = method == "fp8"
        self.packed = self.device.type == "cpu" and has_kernels() and not self.fp8
        if self.fp8 and self.device.type == "cpu":
            logger.warning(
                "fp8 weights have no CPU kernel: every matmul dequantizes its weight (slow); "
                "int8 is the CPU's 8-bit format"
            )
        self.pending = {f"{name}.weight": (name, m) for name, m in _linears(model)}
        self.params = dict(model.named_parameters())
        self.blocks: dict[str, tuple[Tensor, Tensor]] = {}  # `stage_blocks`
        self.count = 0

    def bits(self, param_name: str) -> int:
        """The bits a matrix is held at: int4's, but 8 for the LM head and `eight_bit`'s."""
        is_wide = _is_lm_head(param_name.removesuffix(".weight")) or param_name in self.eight_bit
        return 4 if self.method == "int4" and not is_wide else 8

    def held_bits(self) -> dict[str, int]:
        """Parameter name -> bits, of the weights this quantizer holds (a tied embedding: 8);
        empty unless it could take a file's blocks as they stand (int8 / int4, groups of 32)."""
        if self.fp8 or self.group != BLOCK_SIZE:
            return {}
        held = {name: self.bits(name) for name in self.pending}
        emb = _tied_embedding(self.model)
        held |= {n: 8 for n, p in self.params.items() if emb is not None and p is emb.weight}
        return held

    def stage_blocks(self, param_name: str) -> tuple[Tensor, Tensor]:
        """(q int8 like the weight, d float16 [..., in / group]): where the parameter's weight
        loader copies a file's blocks (models/gguf_blocks.py) instead of float values; they
        become its quantized weight as they stand."""
        if param_name not in self.blocks:
            shape = self.params[param_name].shape
            self.blocks[param_name] = (
                torch.empty(shape, dtype=torch.int8),
                torch.empty(*shape[:-1], shape[-1] // self.group, dtype=torch.float16),
            )
        return self.blocks[param_name]

    def loaded(self, param_name: str) -> None:
        if param_name in self.pending:
            self._quantize(*self.pending.pop(param_name))

    def _weight(
        self, param_name: str, w: Tensor, bits: int, e: int | None = None
    ) -> QuantizedWeight:
        """w [n, k] (expert e's of stacked [E, n, k]) quantized, or its staged blocks as they stand."""
        if param_name in self.blocks:
            q, d = self.blocks[param_name]
            q, d = (q, d) if e is None else (q[e], d[e])
            return QuantizedWeight.from_int(q, d, bits, self.group, self.packed).to(self.device)
        w = w if e is None else w[e]
        return QuantizedWeight.quantize(w, bits, self.group, self.packed, self.fp8).to(self.device)

    @torch.no_grad()
    def _quantize(self, name: str, m: nn.Module) -> None:
        param = f"{name}.weight"
        if not m.weight.numel():
            return
        bits, w = self.bits(param), m.weight.detach()
        if (
            w.dim() == 3
        ):  # stacked experts (models/moe.py): one quantized matrix and matmul per expert
            m.packed = [
                QuantizedLinear(self._weight(param, w, bits, e), None) for e in range(len(w))
            ]
        else:  # the bias (maybe loaded later) is set in finish()
            m.packed = QuantizedLinear(self._weight(param, w, bits), None)
        self.blocks.pop(param, None)
        m.weight.data = m.weight.data.new_empty(0)
        self.count += len(m.packed) if isinstance(m.packed, list) else 1

    @torch.no_grad()
    def finish(self) -> QuantizationReport:
        for name, m in list(self.pending.values()):
            self._quantize(name, m)
        self.pending.clear()
        for _, m in _linears(self.model):
            if isinstance(m.packed, QuantizedLinear) and m.bias is not None:
                m.packed.bias = m.bias.detach().float().contiguous()
        emb = _tied_embedding(self.model)
        if emb is not None and emb.weight.numel():
            w = emb.weight
            name = next(n for n, p in self.params.items() if p is w)
            qw = self._weight(name, w.detach(), 8)
            self.blocks.pop(name, None)
            emb.packed_lm_head = QuantizedLinear(qw, None)
            emb.quantized, emb.quantized_dtype = qw, self.dtype
            w.data = w.data.new_empty(0)
            self.count += 1
        return QuantizationReport(self.method, self.group, self.count, 0)


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights: parameters, buffers and quantized matrices."""
    total = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    for fn in packed_matmuls(model):
        qw = getattr(fn, "weight", None)
        if isinstance(qw, (QuantizedWeight, Tensor)):
            total += qw.nbytes
    return total

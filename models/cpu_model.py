"""What a model gets on the CPU at load: the C++ fused ops and its matmul weights repacked.

Both use models/cpu_ops' kernels (built once, cached). `pack_for_cpu` runs after the
weights are loaded; `CpuFusedOps` is bound to the model's norms and MLPs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.models import cpu_ops, hugepages
from kvserve.models.fused_ops import FusedOps
from kvserve.models.layers import Linear, VocabEmbedding
from kvserve.models.quantization import QuantizedLinear, QuantizedWeight, packed_matmuls


class CpuFusedOps(FusedOps):
    """The fused C++ ops for bf16 rows (same roundings as the torch ops); anything else, PyTorch."""

    name = "cpu"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if cpu_ops.use_fused_bf16_rows(x):
            # one op, same roundings (in fp32 its sum order differs from HF's: keep PyTorch's)
            return cpu_ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        if (
            cpu_ops.use_fused_bf16_rows(x)
            and residual.is_contiguous()
            and residual.dtype == x.dtype
        ):
            return cpu_ops.add_rms_norm_(residual, x, weight, eps), residual  # sum into residual
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        if cpu_ops.use_fused_bf16_rows(x) and cpu_ops.has_fast_bf16():  # (no scalar fallback)
            return cpu_ops.silu_and_mul(x)  # one op, same roundings
        return super().silu_and_mul(x)

    def rms_norm_heads_(self, heads: Tensor, weight: Tensor, eps: float) -> None:
        if (
            heads.dtype == torch.bfloat16
            and heads.is_cpu
            and heads.stride(2) == 1
            and heads.stride(1) == heads.shape[2]
            and cpu_ops.has_fast_bf16()
        ):
            cpu_ops.rms_norm_heads_(
                heads, weight, eps
            )  # the set's row kernel, in place (as the decoder stack does)
        else:
            super().rms_norm_heads_(heads, weight, eps)


class KernelLinear:
    """x @ W.T (+ bias) with W in models.cpu_ops' packed layout (any kernel set)."""

    def __init__(self, packed: Tensor, bias: Tensor | None, out_features: int) -> None:
        self.weight, self.bias, self.out_features = packed, bias, out_features

    def __call__(self, x: Tensor) -> Tensor:
        return cpu_ops.linear_bf16(x, self.weight, self.bias, self.out_features)


class OneDnnLinear:
    """x @ W.T (+ bias) with W in oneDNN's blocked layout (it streams faster than F.linear's)."""

    def __init__(self, packed: Tensor, bias: Tensor | None) -> None:
        self.weight, self.bias = packed, bias

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")


def pack_for_cpu(model: nn.Module) -> int:
    """Repack every bf16 CPU `Linear` (and a tied LM head) once for fast matmuls; stacked experts
    (models/moe.py's `ExpertLinear`) get one packed matrix per expert.

    With a models.cpu_ops kernel set loaded each weight gets its layout, on
    huge pages: their kernel beats oneDNN at every batch size (docs/performance.md).
    Without them, oneDNN's blocked layout; that uses a private oneDNN op, so anything
    unexpected keeps F.linear. The plain weight's storage is released. Returns the
    number of layers packed.
    """
    linears = [
        m
        for m in model.modules()
        if isinstance(m, Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.bfloat16
        and m.weight.numel()
    ]
    if cpu_ops.has_fast_bf16() and all(m.in_features % 2 == 0 for m in linears):
        return _pack_for_kernels(model, linears)
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        return 0
    try:
        packed = [
            [reorder(w, None) for w in m.weight.detach()]
            if m.weight.dim() == 3
            else reorder(m.weight.detach(), None)
            for m in linears
        ]
    except RuntimeError:  # pragma: no cover - depends on the torch build
        return 0
    for m, weight in zip(linears, packed):
        m.packed = (
            [OneDnnLinear(w, None) for w in weight]
            if isinstance(weight, list)
            else OneDnnLinear(weight, m.bias)
        )
        m.weight.data = m.weight.data.new_empty(0)
    return len(linears)


def quantized_onto_huge_pages(model: nn.Module) -> int:
    """Move the kernels' quantized matrices (and their scales) into one huge-page arena each, as
    the bf16 weights are: every decode step streams all of them, and with 4 KiB pages that is a
    TLB miss every few KB. One matrix is copied at a time. Returns how many moved."""
    weights: dict[int, QuantizedWeight] = {}
    for fn in packed_matmuls(model):
        if isinstance(fn, QuantizedLinear) and fn.weight.packed and not fn.weight.data.is_cuda:
            weights[id(fn.weight)] = fn.weight  # a tied head shares its embedding's
    moved = list(weights.values())
    for field, dtype in (("data", torch.uint8), ("scales", torch.float16)):
        slots = hugepages.arena([tuple(getattr(w, field).shape) for w in moved], dtype)
        for w, slot in zip(moved, slots):
            slot.copy_(getattr(w, field))
            setattr(w, field, slot)
    return len(moved)


def _pack_for_kernels(model: nn.Module, linears: list[Linear]) -> int:
    lm_head = None
    if getattr(model, "tie_word_embeddings", False):
        vocab_size = model.config.vocab_size  # the token embedding, not e.g. GPT-2's positions
        lm_head = next(
            (
                emb
                for emb in model.modules()
                if isinstance(emb, VocabEmbedding)
                and getattr(emb, "vocab_size", emb.weight.shape[0])
                == vocab_size  # a rank's shard too
                and emb.weight.dtype == torch.bfloat16
                and emb.packed_lm_head is None
            ),
            None,
        )
    # stacked experts ([E, out, in], models/moe.py): one matrix, and one kernel, per expert
    matrices = [
        w
        for m in linears
        for w in (m.weight.detach() if m.weight.dim() == 3 else [m.weight.detach()])
    ]
    weights = matrices + ([lm_head.weight] if lm_head is not None else [])
    # one huge-page arena (every decode step streams all of it), filled one matrix at a time
    slots = iter(
        hugepages.arena([cpu_ops.packed_linear_shape(w.shape) for w in weights], torch.bfloat16)
    )
    for m in linears:
        bias = None if m.bias is None else m.bias.detach().float()
        kernels = [
            KernelLinear(cpu_ops.pack_linear_weight(w, out=next(slots)), bias, m.out_features)
            for w in (m.weight.detach() if m.weight.dim() == 3 else [m.weight.detach()])
        ]
        m.packed = kernels if m.weight.dim() == 3 else kernels[0]
        m.weight.data = m.weight.data.new_empty(0)
    if lm_head is not None:
        packed = cpu_ops.pack_linear_weight(lm_head.weight.detach(), out=next(slots))
        lm_head.packed_lm_head = KernelLinear(packed, None, lm_head.weight.shape[0])
    return len(linears)

"""Layers shared by the model files: norms, rotary embedding, activations, packed linears.

Every parameter may carry a `weight_loader(param, loaded_weight[, shard_id])` attribute;
`models/loader.py` calls it (or `default_weight_loader`) for each checkpoint tensor.
Loaders check shapes and raise `ValueError` quoting both shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import cpu_ops, hugepages

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_shape(param: Tensor, loaded: Tensor, what: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch{what}: checkpoint has {tuple(loaded.shape)}, model expects {tuple(param.shape)}"
        )


@torch.no_grad()
def default_weight_loader(param: Tensor, loaded: Tensor) -> None:
    """Copy a whole tensor (dtype/device converted by `copy_`)."""
    check_shape(param, loaded)
    param.copy_(loaded)


class RMSNorm(nn.Module):
    """RMSNorm with Hugging Face numerics: normalize in fp32, round to the model dtype, then scale.

    `F.rms_norm` on a bf16/fp16 input normalizes in fp32 and rounds once, exactly like
    HF's `.to(input_dtype)`; HF then multiplies by the weight in the model dtype, so the
    weight stays outside the fused op (passing it in would round only once: 1 ulp off
    HF). In fp32 both are the same single fused op.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden] -> [..., hidden]
        if cpu_ops.use_fused_bf16_rows(x):
            # one op, same roundings (in fp32 its sum order differs from HF's: keep PyTorch's)
            return torch.ops.kvserve.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x, self.shape, None, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The pre-norm residual step: (norm(residual + x), residual + x), the sum rounded to the
        model dtype as `residual + x` is. The fused CPU op writes the sum into `residual`."""
        if cpu_ops.use_fused_bf16_rows(x) and residual.is_contiguous() and residual.dtype == x.dtype:
            return torch.ops.kvserve.add_rms_norm_(residual, x, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


def rope_parameters(config: PretrainedConfig) -> dict:
    """The rope settings of an HF config as one dict with `rope_type` and `rope_theta`.

    transformers >= 5 stores them in `config.rope_parameters`; 4.x in
    `config.rope_theta` plus an optional `config.rope_scaling` dict.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("rope_theta", 10000.0)
    return params


def rope_inv_freq(head_dim: int, params: dict) -> Tensor:
    """Inverse frequencies [head_dim // 2] (fp32) for rope types default, linear and llama3."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (supported: 'default', 'linear', 'llama3')"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF `rotate_half`) with a cos/sin cache indexed by position.

    The cache is built once in fp32 (like HF) and stored in the model dtype:
    `cos_sin_cache[p] = [cos(p * f) repeated twice, sin(p * f) with the first half negated]`,
    so `x * cos + flip_halves(x) * sin` equals HF's `x * cos + rotate_half(x) * sin` bit for bit.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.params = params
        rope_inv_freq(head_dim, params)  # validate the rope type at construction
        self.register_buffer("cos_sin_cache", torch.empty(max_position, 2, head_dim), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the cache in place; the loader calls this after materializing meta tensors."""
        cache = self.cos_sin_cache  # [max_position, 2, head_dim]
        if cache.is_meta:
            return
        inv_freq = rope_inv_freq(self.head_dim, self.params).to(cache.device)
        positions = torch.arange(self.max_position, device=cache.device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        cache[:, 0].copy_(torch.cat((cos, cos), dim=-1))
        cache[:, 1].copy_(torch.cat((-sin, sin), dim=-1))

    def forward(self, positions: Tensor) -> Tensor:  # [T] -> [T, 2, head_dim]
        return self.cos_sin_cache.index_select(0, positions)


def apply_rotary_inplace(x: Tensor, cos_sin: Tensor, num_heads: int, head_dim: int) -> bool:
    """Rotate the first `num_heads` heads of each row of x [T, >= num_heads * D] in place with
    the fused CPU op (same numerics as `apply_rotary`); False (x untouched) where it does not apply."""
    if x.stride(1) != 1 or not cpu_ops.use_fused(x) or not cos_sin.is_contiguous():
        return False
    if head_dim % 32 and x.shape[0] > cpu_ops.FUSED_MAX_ROWS:  # only the scalar path fits this head_dim
        return False
    torch.ops.kvserve.rotary_(x, cos_sin, num_heads, head_dim)
    return True


def apply_rotary(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x [T, num_heads, head_dim] (any strides), cos_sin [T, 2, head_dim] -> new [T, num_heads, head_dim]."""
    cos = cos_sin[:, None, 0]  # [T, 1, head_dim]
    sin = cos_sin[:, None, 1]
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * sin


def silu_and_mul(x: Tensor) -> Tensor:  # [T, 2 * I] -> [T, I]
    if cpu_ops.use_fused_bf16_rows(x) and cpu_ops.has_fast_bf16():  # (no scalar fallback)
        return torch.ops.kvserve.silu_and_mul(x)  # one op, same roundings
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class Linear(nn.Module):
    """`y = x @ W.T + b` with HF's [out, in] weight layout and a whole-tensor loader."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    # Set by `pack_for_cpu` (CPU, bf16): the weight in models.cpu_ops' layout (AVX512-BF16
    # CPUs) or else in oneDNN's blocked layout; the plain weight is then freed.
    cpu_kernel_weight: Tensor | None = None
    cpu_kernel_bias: Tensor | None = None  # float32
    cpu_onednn_weight: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        if self.cpu_kernel_weight is not None:
            return cpu_ops.linear_bf16(x, self.cpu_kernel_weight, self.cpu_kernel_bias, self.out_features)
        if self.cpu_onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.cpu_onednn_weight, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)


def pack_for_cpu(model: nn.Module) -> int:
    """Repack every bf16 CPU `Linear` (and a tied LM head) once for fast matmuls.

    With models.cpu_ops' kernels (AVX512-BF16 CPUs) each weight gets their layout, on
    huge pages: their kernel beats oneDNN at every batch size here (docs/benchmarks.md).
    Without them, oneDNN's blocked layout (it streams faster than F.linear's); that uses
    a private oneDNN op, so anything unexpected keeps F.linear. The plain weight's
    storage is released. Returns the number of layers packed.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16 and m.weight.numel()]
    if cpu_ops.has_fast_bf16() and all(m.in_features % 2 == 0 for m in linears):
        return _pack_for_kernels(model, linears)
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        return 0
    try:
        packed = [reorder(m.weight.detach(), None) for m in linears]
    except RuntimeError:  # pragma: no cover - depends on the torch build
        return 0
    for m, weight in zip(linears, packed):
        m.cpu_onednn_weight = weight
        m.weight.data = m.weight.data.new_empty(0)
    return len(linears)


def _pack_for_kernels(model: nn.Module, linears: list[Linear]) -> int:
    lm_head = None
    if getattr(model, "tie_word_embeddings", False):
        vocab_size = model.config.vocab_size  # the token embedding, not e.g. GPT-2's positions
        lm_head = next((emb for emb in model.modules() if isinstance(emb, VocabEmbedding)
                        and emb.weight.shape[0] == vocab_size and emb.weight.dtype == torch.bfloat16), None)
    weights = [m.weight for m in linears] + ([lm_head.weight] if lm_head is not None else [])
    # one huge-page arena (every decode step streams all of it), filled one matrix at a time
    slots = hugepages.arena([cpu_ops.packed_linear_shape(w.shape) for w in weights], torch.bfloat16)
    for m, slot in zip(linears, slots):
        cpu_ops.pack_linear_weight(m.weight.detach(), out=slot)
        m.cpu_kernel_weight = slot
        m.cpu_kernel_bias = None if m.bias is None else m.bias.detach().float()
        m.weight.data = m.weight.data.new_empty(0)
    if lm_head is not None:
        lm_head.cpu_lm_head_weight = cpu_ops.pack_linear_weight(lm_head.weight.detach(), out=slots[-1])
    return len(linears)


class PackedLinear(Linear):
    """Several linears sharing an input, stored as one matmul (e.g. q/k/v or gate/up).

    `shard_ids[i]` names the checkpoint tensor that fills output rows
    `sum(output_sizes[:i]) : sum(output_sizes[:i+1])`; the model's
    `packed_modules_mapping` routes HF names to (this module, shard id).
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], shard_ids: Sequence, bias: bool = False
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        assert len(output_sizes) == len(shard_ids)
        self.output_sizes = list(output_sizes)
        self.shard_ids = list(shard_ids)
        for p in self.parameters():
            p.weight_loader = self.weight_loader
            p.shard_ids = self.shard_ids

    @torch.no_grad()
    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id=None) -> None:
        if shard_id is None:  # a checkpoint that already stores the packed tensor
            default_weight_loader(param, loaded)
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {self.shard_ids})")
        i = self.shard_ids.index(shard_id)
        offset, size = sum(self.output_sizes[:i]), self.output_sizes[i]
        target = param.narrow(0, offset, size)
        check_shape(target, loaded, f" in shard {shard_id!r}")
        target.copy_(loaded)


class VocabEmbedding(nn.Module):
    """Token embedding [vocab, hidden]; also serves as the tied LM head (`lm_head`)."""

    cpu_lm_head_weight: Tensor | None = None  # set by `pack_for_cpu` for a tied head

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, hidden]
        return F.embedding(ids, self.weight)

    def lm_head(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab]
        if self.cpu_lm_head_weight is not None:
            return cpu_ops.linear_bf16(hidden, self.cpu_lm_head_weight, None, self.weight.shape[0])
        return F.linear(hidden, self.weight)

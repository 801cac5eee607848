"""Layers shared by the model files: norms, rotary embedding, activations, packed linears.

Device-specific code lives elsewhere and is bound once at load: the fused small ops
(`models/fused_ops.py`) and repacked matmul weights (`models/cpu_model.py`).

Every parameter may carry a `weight_loader(param, loaded_weight[, shard_id])` attribute;
`models/loader.py` calls it (or `default_weight_loader`) for each checkpoint tensor, given
as a `LazyTensor` (a tensor works too): a loader reads only the part it keeps, so a
tensor-parallel rank never reads the whole checkpoint (models/parallel.py).
Loaders check shapes and raise `ValueError` quoting both shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.models.fused_ops import TORCH_OPS, FusedOps

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LazyTensor:
    """A checkpoint tensor read only when asked: `narrow` and `t` are free, `read()` reads just
    the selected part. The source is a tensor, or an open safetensors file and a name (then a
    part is read with `get_slice(name)[...]`, the whole with `get_tensor(name)`)."""

    __slots__ = ("_file", "_name", "_tensor", "_ranges", "_transposed")

    def __init__(
        self,
        tensor: Tensor | None = None,
        file=None,
        name: str | None = None,
        ranges: tuple[tuple[int, int], ...] | None = None,
        transposed: bool = False,
    ) -> None:
        self._tensor, self._file, self._name = tensor, file, name
        if ranges is None:
            shape = tensor.shape if tensor is not None else file.get_slice(name).get_shape()
            ranges = tuple((0, int(n)) for n in shape)
        self._ranges = ranges  # (start, stop) per dimension of the source
        self._transposed = transposed

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(stop - start for start, stop in self._ranges)
        return shape[::-1] if self._transposed else shape

    def _with(self, ranges, transposed: bool) -> LazyTensor:
        return LazyTensor(self._tensor, self._file, self._name, ranges, transposed)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """Like `Tensor.narrow` (dim counts in this view's order)."""
        src_dim = len(self._ranges) - 1 - dim if self._transposed else dim
        first, stop = self._ranges[src_dim]
        if start < 0 or length < 0 or first + start + length > stop:
            raise ValueError(
                f"cannot narrow dim {dim} of a {self.shape} tensor to [{start}, {start + length})"
            )
        ranges = list(self._ranges)
        ranges[src_dim] = (first + start, first + start + length)
        return self._with(tuple(ranges), self._transposed)

    def t(self) -> LazyTensor:
        """The transpose of a 2-D tensor (HF Conv1D weights are [in, out])."""
        return self._with(self._ranges, not self._transposed) if len(self._ranges) == 2 else self

    def read(self) -> Tensor:
        index = tuple(slice(start, stop) for start, stop in self._ranges)
        if self._tensor is not None:
            x = self._tensor[index]
        else:
            part = self._file.get_slice(self._name)
            is_whole = all(
                start == 0 and stop == n for (start, stop), n in zip(self._ranges, part.get_shape())
            )
            x = self._file.get_tensor(self._name) if is_whole else part[index]
        return x.t() if self._transposed else x


def as_lazy(loaded: Tensor | LazyTensor) -> LazyTensor:
    return loaded if isinstance(loaded, LazyTensor) else LazyTensor(loaded)


def check_shape(param: Tensor, loaded: Tensor | LazyTensor, what: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch{what}: checkpoint has {tuple(loaded.shape)}, model expects {tuple(param.shape)}"
        )


@torch.no_grad()
def default_weight_loader(param: Tensor, loaded: Tensor | LazyTensor) -> None:
    """Copy a whole tensor (dtype/device converted by `copy_`)."""
    check_shape(param, loaded)
    param.copy_(as_lazy(loaded).read())


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
        self.ops: FusedOps = TORCH_OPS  # the device's, set at load

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden] -> [..., hidden]
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The pre-norm residual step: (norm(residual + x), residual + x), the sum rounded to the
        model dtype as `residual + x` is (fused ops may write it into `residual`)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def norm_heads_(self, heads: Tensor) -> None:
        """The norm of each head of heads [T, H, D] (a view into qkv: Qwen3's q/k norms), in place."""
        self.ops.rms_norm_heads_(heads, self.weight, self.eps)


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
    # on the CPU even inside the loader's meta-device context: meta arange imports torch._dynamo, slow at start-up
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (base ** (steps.float() / head_dim))
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

    Partial rotary (`rotary_dim < head_dim`, HF rotating only the first `rotary_dim` features of a
    head): every backend rotates pairs (i, i + head_dim / 2), so the model stores q and k with each
    head's features permuted by `partial_rotary_permutation` (HF's pairs (i, i + rotary_dim / 2)
    land there) and the cache holds cos 1, sin 0 on the features not rotated, which pass through
    exactly. q.k is the same sum in another order; v and the attention output are not permuted.
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict, rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(
                f"rotary_dim {self.rotary_dim} must be even and at most head_dim {head_dim}"
            )
        self.max_position = max_position
        self.params = params
        self.inv_freq_and_scaling()  # validate the rope type at construction
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_position, 2, head_dim), persistent=False
        )
        self.reset_buffers()

    def inv_freq_and_scaling(self) -> tuple[Tensor, float]:
        """Inverse frequencies [rotary_dim // 2] (fp32) and the factor HF multiplies cos and sin by."""
        return rope_inv_freq(self.rotary_dim, self.params), 1.0

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the cache in place; the loader calls this after materializing meta tensors."""
        cache = self.cos_sin_cache  # [max_position, 2, head_dim]
        if cache.is_meta:
            return
        inv_freq, scaling = self.inv_freq_and_scaling()
        positions = torch.arange(self.max_position, device=cache.device, dtype=torch.int64).float()
        freqs = (
            positions[:, None] * inv_freq.to(cache.device)[None, :]
        )  # [max_position, rotary_dim // 2]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        num_pass = (self.head_dim - self.rotary_dim) // 2  # per half: features that are not rotated
        if num_pass:
            cos = torch.cat((cos, cos.new_ones(self.max_position, num_pass)), dim=-1)
            sin = torch.cat((sin, sin.new_zeros(self.max_position, num_pass)), dim=-1)
        cache[:, 0].copy_(torch.cat((cos, cos), dim=-1))
        cache[:, 1].copy_(torch.cat((-sin, sin), dim=-1))

    def forward(self, positions: Tensor) -> Tensor:  # [T] -> [T, 2, head_dim]
        return self.cos_sin_cache.index_select(0, positions)


def partial_rotary_permutation(head_dim: int, rotary_dim: int) -> Tensor:
    """perm [head_dim] with `new[j] = old[perm[j]]`: HF's rotated pairs (i, i + rotary_dim / 2) at
    (i, i + head_dim / 2), the features it does not rotate in the rest of each half (in order)."""
    half, rot_half = head_dim // 2, rotary_dim // 2
    first = list(range(rot_half)) + list(range(rotary_dim, rotary_dim + half - rot_half))
    second = list(range(rot_half, rotary_dim)) + list(range(rotary_dim + half - rot_half, head_dim))
    return torch.tensor(first + second, dtype=torch.int64, device="cpu")


def apply_rotary(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x [T, num_heads, head_dim] (any strides), cos_sin [T, 2, head_dim] -> new [T, num_heads, head_dim]."""
    cos = cos_sin[:, None, 0]  # [T, 1, head_dim]
    sin = cos_sin[:, None, 1]
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * sin


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,  # Marian's name for it
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

    # Set at load by a device module that repacks the weight for its own matmul (models/cpu_model.py);
    # the plain weight is then freed.
    packed: Callable[[Tensor], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


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
        target.copy_(as_lazy(loaded).read())


class VocabEmbedding(nn.Module):
    """Token embedding [vocab, hidden]; also serves as the tied LM head (`lm_head`)."""

    packed_lm_head: Callable[[Tensor], Tensor] | None = None  # a tied head repacked at load
    quantized = None  # a tied head quantized at load (models/quantization.py): rows come from it
    quantized_dtype: torch.dtype | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, hidden]
        return self.rows(ids)

    def rows(self, ids: Tensor) -> Tensor:
        if self.quantized is not None:
            return self.quantized.rows(ids, self.quantized_dtype)
        return F.embedding(ids, self.weight)

    def lm_head(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab]
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        return F.linear(hidden, self.weight)

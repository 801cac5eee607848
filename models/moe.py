"""The sparse mixture-of-experts MLP shared by the MoE families (qwen3_moe.py, mixtral.py).

A router picks `top_k` experts per token exactly as transformers does (softmax in fp32, then
`torch.topk`, so ties pick the same experts), and the experts run grouped: the step's
(token, expert) pairs are sorted by expert id, each active expert multiplies its rows, and the
outputs, scaled by the routing weights, are summed back per token.

Expert weights are stacked, one 3-D tensor per projection: `gate_up_proj` [E, 2 * I, hidden]
(gate rows, then up rows) and `down_proj` [E, hidden, I]. They load from either checkpoint
layout: Hugging Face's per-expert tensors (`experts.{e}.gate_proj.weight`, what
`save_pretrained` writes) or the fused 3-D ones (`experts.gate_up_proj`, transformers' module
layout). How the experts' matmuls run is chosen at load:

* CUDA or the Triton ops (plain weights): one grouped GEMM launch per projection over all
  experts (models/kernels/triton_moe.py), no host sync (CUDA graphs capture it).
* otherwise one matmul per active expert on its gathered rows: `F.linear` on the stacked
  weight, or the per-expert CPU kernels (bf16 packed, int8/int4) that models/cpu_model.py and
  models/quantization.py put in `ExpertLinear.packed`. The expert counts come to the host for
  the loop, so while a CUDA graph is captured (quantized experts on CUDA) every expert runs on
  every token instead, scaled by zero where not chosen (`every_expert`).

Tensor parallelism splits every expert's intermediate dim over the ranks like a dense MLP
(gate/up rows, down columns); the block all-reduces its summed output once.

Shapes: T = tokens, k = top_k, E = experts, H = hidden, I = this rank's expert intermediate.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.models.fused_ops import TORCH_OPS, FusedOps
from kvserve.models.layers import Linear, as_lazy, default_weight_loader, get_activation
from kvserve.models.parallel import check_full_shape, current, split


class TopKRouter(nn.Module):
    """Router logits -> (weights [T, k], expert ids [T, k]) with transformers' ops and roundings.

    `renormalize`: divide the top-k probabilities by their sum (Mixtral always; Qwen3-MoE when
    `norm_topk_prob`). `weights_in_model_dtype`: round them to the model dtype (Qwen3-MoE) or
    keep them fp32 (Mixtral). The router stays in the model dtype: never quantized or repacked,
    so the experts chosen are transformers' own."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        renormalize: bool,
        weights_in_model_dtype: bool,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.weight.weight_loader = default_weight_loader
        self.top_k, self.renormalize, self.weights_in_model_dtype = (
            top_k,
            renormalize,
            weights_in_model_dtype,
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # [T, H] -> [T, k], [T, k]
        logits = F.linear(x, self.weight)  # [T, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids


class ExpertLinear(Linear):
    """`num_experts` linears of one shape as one weight [E, out, in] (this rank's slice).

    `packed`, when a device module sets it at load, is one callable per expert (the CPU
    kernels); `expert(e, x)` multiplies rows by expert e either way. Shard ids are
    `(e, part)`: one checkpoint tensor per expert and part (gate 0 / up 1; down has one part).
    """

    packed: list[Callable[[Tensor], Tensor]] | None = None

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, parts: int, split_dim: int
    ) -> None:
        nn.Module.__init__(self)
        self.tp = current()
        self.num_experts, self.parts, self.split_dim = num_experts, parts, split_dim
        if split_dim == 0:  # column parallel: each part's rows split over ranks
            out_features = parts * split(
                out_features // parts, self.tp.size, "moe_intermediate_size"
            )
        else:  # row parallel: input features split
            in_features = split(in_features, self.tp.size, "moe_intermediate_size")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.register_parameter("bias", None)
        self.weight.weight_loader = self.weight_loader
        self.weight.shard_ids = [(e, p) for e in range(num_experts) for p in range(parts)]

    def expert(self, e: int, x: Tensor) -> Tensor:  # [n, in] -> [n, out]
        if self.packed is not None:
            return self.packed[e](x)
        return F.linear(x, self.weight[e])

    @torch.no_grad()
    def weight_loader(self, param: Tensor, loaded, shard_id: tuple[int, int] | None = None) -> None:
        loaded = as_lazy(loaded)
        if shard_id is not None:  # one expert's part, e.g. `experts.3.up_proj.weight`
            self._load_part(param, loaded, *shard_id, lead=0)
            return
        full = list(
            param.shape
        )  # the fused 3-D tensor: [E, parts * I, H] or [E, H, I], all ranks' I
        full[1 + self.split_dim] *= self.tp.size
        check_full_shape(loaded, full, " (stacked experts)")
        rows = full[1] // self.parts
        for e in range(self.num_experts):
            one = loaded.narrow(0, e, 1)
            for p in range(self.parts):
                self._load_part(
                    param,
                    one.narrow(1, p * rows, rows) if self.split_dim == 0 else one,
                    e,
                    p,
                    lead=1,
                )

    def _load_part(self, param: Tensor, loaded, e: int, p: int, lead: int) -> None:
        """Part p of expert e from `loaded` (its full size, after `lead` leading dims of 1): this rank's slice."""
        if not 0 <= e < self.num_experts or not 0 <= p < self.parts:
            raise ValueError(
                f"no expert part {(e, p)} in {self.num_experts} experts of {self.parts} parts"
            )
        size = (
            param.shape[1] // self.parts if self.split_dim == 0 else param.shape[2]
        )  # this rank's I
        full = [param.shape[2]] * 2 if self.split_dim == 0 else [param.shape[1]] * 2
        full[self.split_dim] = size * self.tp.size
        check_full_shape(loaded, [1] * lead + full, f" in expert {e}")
        part = loaded.narrow(lead + self.split_dim, self.tp.rank * size, size).read()
        target = param[e].narrow(0, p * size, size) if self.split_dim == 0 else param[e]
        target.copy_(part.reshape(target.shape))


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def group_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids [T, k] -> (order [T*k]: pair indices sorted by expert, stable; token of each sorted pair [T*k];
    counts [E]: pairs per expert). Sorted pair i belongs to token order[i] // k, slot order[i] % k."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    # (not bincount: on CUDA its output size waits for the max id, a host sync that CUDA graphs forbid)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat)
    )
    return order, order // ids.shape[1], counts


class FusedExperts(nn.Module):
    """The experts of one MoE layer: gate/up, activation * up, down, weighted sum per token."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = ExpertLinear(
            num_experts, hidden_size, 2 * intermediate_size, parts=2, split_dim=0
        )
        self.down_proj = ExpertLinear(
            num_experts, intermediate_size, hidden_size, parts=1, split_dim=1
        )
        self.act = None if hidden_act == "silu" else get_activation(hidden_act)
        self.ops: FusedOps = TORCH_OPS  # the device's, set at load

    def activation(self, gate_up: Tensor) -> Tensor:  # [n, 2 * I] -> [n, I]
        if self.act is None:
            return self.ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(
        self, x: Tensor, weights: Tensor, ids: Tensor
    ) -> Tensor:  # [T, H], [T, k], [T, k] -> [T, H]
        plain = self.gate_up_proj.packed is None
        grouped = plain and (self.ops.name == "triton" or (x.is_cuda and _has_triton()))
        if not grouped and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.every_expert(x, weights, ids)
        order, tokens, counts = group_by_expert(ids, self.num_experts)
        sorted_weights = weights.flatten()[order]  # [T*k]
        out = torch.zeros_like(x)
        if grouped:
            from kvserve.models.kernels.triton_moe import (
                grouped_gemm,  # imports triton: only when chosen
            )

            h = grouped_gemm(
                x[tokens], self.gate_up_proj.weight, counts
            )  # [T*k, 2I] pairs sorted by expert
            y = grouped_gemm(self.activation(h), self.down_proj.weight, counts)  # [T*k, H]
            return out.index_add_(0, tokens, (y * sorted_weights[:, None]).to(x.dtype))
        # one matmul per active expert; the counts come to the host (free on the CPU, where this path runs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = tokens[start : start + n]  # [n] this expert's tokens
            h = self.down_proj.expert(
                e, self.activation(self.gate_up_proj.expert(e, x[rows]))
            )  # [n, H]
            # transformers' rounding: the product in the weights' dtype (fp32 for Mixtral), then the model's
            out.index_add_(0, rows, (h * sorted_weights[start : start + n, None]).to(x.dtype))
            start += n
        return out

    def every_expert(
        self, x: Tensor, weights: Tensor, ids: Tensor
    ) -> Tensor:  # [T, H], [T, k], [T, k] -> [T, H]
        """Every expert on every token, scaled by its routing weight (0 where not chosen): no host
        sync, so a CUDA graph can hold it (quantized experts on CUDA; it reads every expert)."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            w = (weights * (ids == e)).sum(-1, keepdim=True)  # [T, 1]
            h = self.down_proj.expert(e, self.activation(self.gate_up_proj.expert(e, x)))
            out += (h * w).to(x.dtype)
        return out


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's scalar gate of the shared expert, sigmoid(x @ w.T): [T, H] -> [T, 1] (replicated)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoeBlock(nn.Module):
    """Router + experts, and with `shared_intermediate_size` a gated shared expert that every token
    runs (Qwen2-MoE): [T, H] -> [T, H]."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        renormalize: bool,
        weights_in_model_dtype: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.tp = current()
        self.gate = TopKRouter(num_experts, hidden_size, top_k, renormalize, weights_in_model_dtype)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            from kvserve.models.llama import LlamaMLP  # (llama.py imports nothing of this file)

            shape = SimpleNamespace(
                hidden_size=hidden_size,
                intermediate_size=shared_intermediate_size,
                hidden_act=hidden_act,
            )
            self.shared_expert = LlamaMLP(shape)  # a dense, tensor-parallel MLP
            self.shared_expert_gate = SharedExpertGate(hidden_size)

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.tp.size > 1:  # each rank summed its slice of every expert's intermediate dim
            self.tp.all_reduce(out)
        if self.shared_expert is not None:
            out = out + self.shared_expert_gate(x) * self.shared_expert(x)
        return out


def moe_weight_name(
    name: str, experts_prefix: str, part_names: dict[str, tuple[str, int]]
) -> str | tuple[str, tuple[int, int]]:
    """A checkpoint name -> this model's name, with the shard id of a per-expert tensor.

    `experts_prefix`: the checkpoint's path of the experts (e.g. `.mlp.experts.`);
    `part_names`: per-expert tensor name -> (stacked projection, part), e.g.
    {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}."""
    if experts_prefix not in name:
        return name
    head, tail = name.split(experts_prefix, 1)
    pieces = tail.split(".")
    if len(pieces) == 1:  # transformers' fused layout: `experts.gate_up_proj` [E, 2I, H]
        return f"{head}.mlp.experts.{tail}.weight"
    if (
        len(pieces) == 3
        and pieces[0].isdigit()
        and pieces[1] in part_names
        and pieces[2] == "weight"
    ):
        proj, part = part_names[pieces[1]]
        return f"{head}.mlp.experts.{proj}.weight", (int(pieces[0]), part)
    return name

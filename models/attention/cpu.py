"""The CPU backend: models/cpu_ops' C++ kernels where they apply, the torch reference elsewhere.

* rotary: one fused in-place op over the q and k heads of the packed qkv rows;
* the cache write: one op for K and V;
* attention: with a kernel set loaded, in bf16 (head_dim a multiple of 32, at most 256), the
  paged decode kernel for all decode rows at once and the flash-style prefill kernel
  per prefill request, both reading K/V in place through the block table; otherwise
  gather + SDPA (faster than scalar C++ in fp32: docs/performance.md).
  Both kernels soft-cap the scores of a layer with `logit_softcap` (Gemma 2).
Which of these apply is settled once, when the loader builds the backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvserve.models import cpu_ops
from kvserve.models.attention.layer import Attention
from kvserve.models.attention.metadata import ForwardContext
from kvserve.models.attention.torch_ref import (
    PrefillRequest,
    StepPlan,
    TorchAttentionBackend,
    cos_sin_of,
)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, dtype: torch.dtype, head_dims: set[int]) -> None:
        has_ops = cpu_ops.load()
        self.paged_kernels = (
            has_ops
            and dtype == torch.bfloat16
            and cpu_ops.has_fast_bf16()
            and all(d % 32 == 0 and d <= 256 for d in head_dims)
        )
        self.fused_write = has_ops
        self.fused_rotary = has_ops and dtype in (torch.bfloat16, torch.float32)

    def rotate(
        self, layer: Attention, context: ForwardContext, qkv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        if layer.rotary is None or not self._rotates_in_place(layer, qkv):
            return super().rotate(layer, context, qkv)
        cpu_ops.rotary_(
            qkv, cos_sin_of(layer, context), layer.num_heads + layer.num_kv_heads, layer.head_dim
        )
        return layer.split_qkv(qkv)

    def _rotates_in_place(self, layer: Attention, qkv: Tensor) -> bool:
        if not self.fused_rotary or qkv.stride(1) != 1 or not cpu_ops.use_fused(qkv):
            return False
        # only the scalar path fits a head_dim that is not a multiple of 32
        return layer.head_dim % 32 == 0 or qkv.shape[0] <= cpu_ops.FUSED_MAX_ROWS

    def write_kv(self, layer: Attention, k: Tensor, v: Tensor, slots: Tensor) -> None:
        heads_contiguous = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v))
        if self.fused_write and heads_contiguous:
            cpu_ops.write_kv_cache(k, v, *layer.kv, slots)
        else:
            super().write_kv(layer, k, v, slots)

    def decode(self, layer: Attention, plan: StepPlan, q: Tensor) -> Tensor:
        if not self.paged_kernels:
            return super().decode(layer, plan, q)
        if layer.kv_cache is None:
            raise RuntimeError("decode rows need a kv_cache (assign Attention.kv_cache first)")
        return cpu_ops.paged_decode_attention(
            q,
            *layer.kv,
            plan.decode_block_table,
            plan.decode_seq_lens,
            layer.scale,
            layer.sliding_window,
            softcap=layer.logit_softcap,
        )

    def prefill(
        self, layer: Attention, plan: StepPlan, p: PrefillRequest, q: Tensor, k: Tensor, v: Tensor
    ) -> Tensor:
        if not self.paged_kernels or layer.kv_cache is None:
            return super().prefill(layer, plan, p, q, k, v)
        # causal over the paged cache (this chunk's K/V are already written), no gathers
        return cpu_ops.paged_prefill_attention(
            q[p.start : p.start + p.query_len],
            *layer.kv,
            plan.meta.block_table[p.req_idx],
            p.seq_len,
            layer.scale,
            layer.sliding_window,
            softcap=layer.logit_softcap,
        )

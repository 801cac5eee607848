"""Qwen2 and Qwen3 decoders, built from the Llama blocks with their quirks.

* Qwen2: q/k/v projections have a bias (o_proj does not); optional sliding
  window on the layers that `config.layer_types` marks.
* Qwen3: no q/k/v bias (unless `attention_bias`), explicit `head_dim` that need
  not equal hidden / heads, and a per-head RMSNorm on q and k before rotary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from kvserve.models.layers import RMSNorm, RotaryEmbedding
from kvserve.models.llama import BaseModelMixin, LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2Attention(LlamaAttention):
    qkv_bias = True
    o_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)  # shared by all query heads
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KvH) * D]
        q, k, _ = self.attn.split_qkv(qkv)
        self.q_norm.norm_heads_(q)  # per head, before the rotary embedding; in place in qkv
        self.k_norm.norm_heads_(k)
        return self.o_proj(self.attn(qkv))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention


class Qwen2ModelForEmbedding(BaseModelMixin, Qwen2ForCausalLM):
    pass


class Qwen3ModelForEmbedding(BaseModelMixin, Qwen3ForCausalLM):
    pass

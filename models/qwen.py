"""Qwen2 and Qwen3 decoders, built from the Llama blocks with their quirks.

* Qwen2: q/k/v projections have a bias (o_proj does not); optional sliding
  window on the layers that `config.layer_types` marks.
* Qwen3: no q/k/v bias (unless `attention_bias`), explicit `head_dim` that need
  not equal hidden / heads, and a per-head RMSNorm on q and k before rotary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from models.layers import RMSNorm, apply_rotary
from models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2Attention(LlamaAttention):
    qkv_bias = True
    o_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)  # shared by all query heads
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def rotate_qk(self, qkv: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
        """qkv [T, (H + 2 KvH) * D] -> q [T, H*D], k [T, KvH*D], normalized per head then rotated."""
        num_tokens = qkv.shape[0]
        q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, -1))
        qk = apply_rotary(torch.cat((q, k), dim=1), cos_sin)  # [T, H + KvH, D]
        return qk[:, : self.num_heads].flatten(1), qk[:, self.num_heads :].flatten(1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

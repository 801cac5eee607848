"""Phi-3 / Phi-4 decoders (`Phi3ForCausalLM`: Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini) with HF names.

Llama's layers (and so the CPU decoder stack, models/cpu_stack.py) with Phi-3's quirks:

* the checkpoint stores q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj` (gate rows first):
  kvserve's own packed layout, loaded as they are (with tensor parallelism each rank reads its
  heads' rows of each part, models/parallel.py);
* LongRoPE (`rope_type` "longrope", older configs "su"): per-frequency short and long factors
  and cos/sin scaled by an attention factor (`LongRopeRotaryEmbedding`, which also says how the
  factors are chosen);
* partial rotary (`partial_rotary_factor`, Phi-4-mini): only the first `rotary_dim` features of
  each head rotate; q/k rows are permuted at load so that every attention backend's full-head
  rotary applies it (`RotaryEmbedding`, `PermutedQKVLinear`);
* a sliding window on every layer when `config.sliding_window` is set (Phi-3-mini-4k: 2047).

Shapes: D = head_dim, R = rotary_dim (D * partial_rotary_factor).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvserve.models.layers import (
    LazyTensor,
    RotaryEmbedding,
    partial_rotary_permutation,
    rope_parameters,
)
from kvserve.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of
from kvserve.models.parallel import QKVParallelLinear

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def phi3_rope(config: PretrainedConfig) -> tuple[dict, int]:
    """(rope parameters with rope_type "default" or "longrope", rotary_dim) as transformers reads them."""
    params = rope_parameters(config)
    if params["rope_type"] in ("su", "yarn"):  # transformers' Phi3Config renames both to longrope
        params["rope_type"] = "longrope"
    if params["rope_type"] not in ("default", "longrope"):
        raise ValueError(
            f"unsupported Phi-3 rope_type {params['rope_type']!r} (supported: 'default', 'longrope')"
        )
    if params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = getattr(
            config, "original_max_position_embeddings", None
        )
    factor = params.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return params, int(head_dim_of(config) * factor)


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE as transformers computes it: `inv_freq = 1 / (factors * theta ** (2i / R))` with
    `short_factor` or `long_factor`, and cos/sin times `attention_factor` (if the config gives none:
    sqrt(1 + ln(s) / ln(L0)) for s = max_position_embeddings / L0 > 1, else 1; L0 =
    original_max_position_embeddings, s = `factor` if the config gives one).

    The factors are one set for every token the server computes, chosen at load: long when the
    served `max_model_len` exceeds L0, else short (`set_max_model_len`; vLLM chooses the same
    way). transformers switches per forward pass by the sequence length, and its generate
    recomputes the whole cache with the long factors when a sequence first exceeds L0; a paged
    cache shared between requests, chunked prefills and preempted requests cannot change a
    token's keys after they are written, so a set per server keeps every cached block valid for
    every request. The logits equal transformers' for every sequence longer than L0 (long) or,
    served with max_model_len <= L0, for every sequence (short); a sequence of at most L0 tokens
    served with a longer max_model_len gets the long factors where transformers uses the short.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict, rotary_dim: int) -> None:
        if params.get("original_max_position_embeddings") is None:
            raise ValueError("a longrope rope scaling needs original_max_position_embeddings")
        self.original_max_position = int(params["original_max_position_embeddings"])
        self.config_max_position = max_position  # the default scale s, whatever max_model_len is
        self.use_long = max_position > self.original_max_position  # the model's own limit served
        super().__init__(head_dim, max_position, params, rotary_dim)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Choose the factors for a server whose sequences are at most `max_model_len` tokens."""
        self.use_long = max_model_len > self.original_max_position
        self.reset_buffers()

    def inv_freq_and_scaling(self) -> tuple[Tensor, float]:
        p = self.params
        key = "long_factor" if self.use_long else "short_factor"
        factors = p.get(key)
        if factors is None or len(factors) != self.rotary_dim // 2:
            raise ValueError(
                f"rope {key} must list rotary_dim / 2 = {self.rotary_dim // 2} numbers, "
                f"got {None if factors is None else len(factors)}"
            )
        exponents = (
            torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu").float()
            / self.rotary_dim
        )
        ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (
            ext * float(p["rope_theta"]) ** exponents
        )  # [R / 2], transformers' expression
        scale = p.get("factor")
        if scale is None:
            scale = self.config_max_position / self.original_max_position
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                1.0
                if scale <= 1.0
                else math.sqrt(1 + math.log(scale) / math.log(self.original_max_position))
            )
        return inv_freq, float(attention_factor)


class PermutedQKVLinear(QKVParallelLinear):
    """q/k/v with each q and k head's features permuted (`partial_rotary_permutation`) as loaded:
    this rank's rows are read, then reordered; v is as in the checkpoint."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, rotary_dim: int
    ) -> None:
        super().__init__(hidden_size, head_dim, num_heads, num_kv_heads)
        self.perm = partial_rotary_permutation(head_dim, rotary_dim)  # [D]

    def shard_rows(self, shard_id, loaded):
        rows = super().shard_rows(shard_id, loaded)
        if shard_id == "v":
            return rows
        x = rows.read()  # [heads * D, hidden] (or the bias [heads * D])
        return LazyTensor(x.unflatten(0, (-1, self.head_dim))[:, self.perm].flatten(0, 1))


class Phi3Attention(LlamaAttention):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        if rotary_emb.rotary_dim < self.head_dim:  # partial rotary: Llama's forward, q/k permuted
            num_heads = config.num_attention_heads
            num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
            self.qkv_proj = PermutedQKVLinear(
                config.hidden_size, self.head_dim, num_heads, num_kv_heads, rotary_emb.rotary_dim
            )


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder + LM head (tied to the embedding in Phi-4-mini)."""

    attention_cls = Phi3Attention

    def rotary_embedding(self, config: PretrainedConfig) -> RotaryEmbedding:
        params, rotary_dim = phi3_rope(config)
        head_dim, max_position = head_dim_of(config), config.max_position_embeddings
        if params["rope_type"] == "longrope":
            return LongRopeRotaryEmbedding(head_dim, max_position, params, rotary_dim)
        return RotaryEmbedding(head_dim, max_position, params, rotary_dim)

"""T5 (v1.0, v1.1 / Flan-T5) encoder-decoder with HF parameter names: the reference forward.

What sets T5 apart from BART: no position embeddings, but a learned bias per head added to the
attention scores, looked up by the bucketed distance between query and key (log-spaced buckets
beyond `num_buckets / 2`, bidirectional in the encoder, only backwards in the decoder); one table
per stack, in its first block, shared by all its layers. Scores are not scaled by
1/sqrt(head_dim). Layer norms are RMS norms without bias, applied before each sub-layer
(pre-LN), and each stack ends with one. The feed-forward is ReLU (v1.0) or gated GELU (v1.1:
`wi_0`, `wi_1`). v1.0 ties the LM head to the embeddings and scales the decoder output by
d_model ** -0.5 first; v1.1 has its own head and no scaling.

Like models/bart.py this is the oracle: dense attention over one request, no KV cache.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.models.layers import get_activation

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def relative_position_bucket(relative_position: Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Tensor:
    """T5's bucket of each (key position - query position): exact below num_buckets / 2 (per
    direction when bidirectional), log-spaced up to max_distance, the last bucket beyond."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class T5LayerNorm(nn.Module):
    """RMS norm with a weight and no bias, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(self.weight.dtype)


class T5Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, is_decoder: bool, has_relative_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.d_kv
        inner = self.num_heads * self.head_dim
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.is_decoder = is_decoder
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        if has_relative_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.num_heads)

    def position_bias(self, query_len: int, key_len: int, device: torch.device) -> Tensor:  # -> [H, Lq, Lk]
        relative = (torch.arange(key_len, device=device)[None, :] - torch.arange(query_len, device=device)[:, None])
        buckets = relative_position_bucket(relative, not self.is_decoder, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)

    def forward(self, x: Tensor, kv_source: Tensor, bias: Tensor | None) -> Tensor:  # [L, d], [M, d] -> [L, d]
        def heads(t: Tensor) -> Tensor:
            return t.view(t.shape[0], self.num_heads, self.head_dim).transpose(0, 1)

        q, k, v = heads(self.q(x)), heads(self.k(kv_source)), heads(self.v(kv_source))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(out.transpose(0, 1).reshape(x.shape[0], -1))


class T5DenseActDense(nn.Module):
    """`wo(act(wi(x)))`, or gated `wo(act(wi_0(x)) * wi_1(x))` (v1.1); HF's `DenseReluDense`."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gated = bool(getattr(config, "is_gated_act", False))
        if self.gated:
            self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.act = get_activation(config.dense_act_fn)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))
        return self.wo(self.act(self.wi(x)))


class _SubLayer(nn.Module):
    """One of HF's `T5LayerSelfAttention` / `T5LayerCrossAttention` / `T5LayerFF`: a pre-norm and
    the sub-layer, whose output is added to the residual stream."""

    def __init__(self, config: PretrainedConfig, name: str, module: nn.Module) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, module)  # HF's name for it: SelfAttention, EncDecAttention, DenseReluDense
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    @property
    def body(self) -> nn.Module:
        return getattr(self, self.name)


class T5Block(nn.Module):
    def __init__(self, config: PretrainedConfig, is_decoder: bool, has_relative_bias: bool) -> None:
        super().__init__()
        layers = [_SubLayer(config, "SelfAttention", T5Attention(config, is_decoder, has_relative_bias))]
        if is_decoder:
            layers.append(_SubLayer(config, "EncDecAttention", T5Attention(config, True, False)))
        layers.append(_SubLayer(config, "DenseReluDense", T5DenseActDense(config)))
        self.layer = nn.ModuleList(layers)

    def forward(self, h: Tensor, self_bias: Tensor, encoder_out: Tensor | None) -> Tensor:
        self_attn, *rest = self.layer
        normed = self_attn.layer_norm(h)
        h = h + self_attn.body(normed, normed, self_bias)
        if encoder_out is not None:
            cross, ff = rest
            h = h + cross.body(cross.layer_norm(h), encoder_out, None)
        else:
            (ff,) = rest
        return h + ff.body(ff.layer_norm(h))


class T5Stack(nn.Module):
    def __init__(self, config: PretrainedConfig, shared: nn.Embedding, is_decoder: bool, num_layers: int) -> None:
        super().__init__()
        self.embed_tokens = shared
        self.is_decoder = is_decoder
        self.block = nn.ModuleList(T5Block(config, is_decoder, i == 0) for i in range(num_layers))
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, input_ids: Tensor, encoder_out: Tensor | None = None) -> Tensor:  # [L] -> [L, d]
        h = self.embed_tokens(input_ids)
        length = input_ids.shape[0]
        bias = self.block[0].layer[0].body.position_bias(length, length, input_ids.device).to(h.dtype)
        if self.is_decoder:  # causal: the future masked out of the shared bias
            future = torch.ones(length, length, dtype=torch.bool, device=h.device).triu(1)
            bias = bias.masked_fill(future, float("-inf"))
        for block in self.block:
            h = block(h, bias, encoder_out)
        return self.final_layer_norm(h)


class T5ForConditionalGeneration(nn.Module):
    """`shared`, `encoder`, `decoder`, and `lm_head` when the head is not tied (v1.1)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, self.shared, False, config.num_layers)
        self.decoder = T5Stack(config, self.shared, True, config.num_decoder_layers or config.num_layers)
        # v1.0 ties the head and scales the decoder output; v1.1 does neither (transformers >= 5 keeps
        # the distinction as `scale_decoder_outputs`, earlier versions as `tie_word_embeddings`)
        self.scale_decoder_outputs = bool(getattr(config, "scale_decoder_outputs", config.tie_word_embeddings))
        if not self.scale_decoder_outputs:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            # checkpoints of Google's have the head; transformers >= 5 ties it and saves none
            self.tied_fallbacks = {"lm_head.weight": "shared.weight"}

    def encode(self, input_ids: Tensor) -> Tensor:  # [S] -> [S, d]
        return self.encoder(input_ids)

    def decode(self, decoder_ids: Tensor, encoder_out: Tensor) -> Tensor:  # [T], [S, d] -> [T, d]
        return self.decoder(decoder_ids, encoder_out)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, d] -> [N, vocab]
        if self.scale_decoder_outputs:
            return F.linear(hidden * self.config.d_model ** -0.5, self.shared.weight)
        return self.lm_head(hidden)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; copies of the shared table are skipped."""
        if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            return None
        if name == "lm_head.weight" and self.scale_decoder_outputs:
            return None
        return name

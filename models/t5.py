"""T5 (v1.0, v1.1 / Flan-T5) encoder-decoder with HF parameter names: the reference forward.

What sets T5 apart from BART: no position embeddings, but a learned bias per head added to the
attention scores, looked up by the bucketed distance between query and key (log-spaced buckets
beyond `num_buckets / 2`, bidirectional in the encoder, only backwards in the decoder); one table
per stack, in its first block, shared by all its layers. Scores are not scaled by
1/sqrt(head_dim). Layer norms are RMS norms without bias, applied before each sub-layer
(pre-LN), and each stack ends with one. The feed-forward is ReLU (v1.0) or gated GELU (v1.1:
`wi_0`, `wi_1`). v1.0 ties the LM head to the embeddings and scales the decoder output by
d_model ** -0.5 first; v1.1 has its own head and no scaling.

Like models/bart.py: `encode` / `decode` are the dense oracle (one request, no KV cache), and
`encode_into_cache` + `forward` what the engine runs over the paged cache (models/seq2seq.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.models.attention.metadata import current_context
from kvserve.models.layers import Linear, RMSNorm, VocabEmbedding, get_activation
from kvserve.models.seq2seq import (
    StepPlan,
    attend_segments,
    kv_holder,
    paged_attention,
    segments,
    step_plan,
    uses_kernels,
    write_kv,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
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
    large = (
        max_exact
        + (
            torch.log(distance.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class T5LayerNorm(RMSNorm):
    """T5's layer norm is an RMS norm with a weight and no bias, with HF's numerics (normalize in
    float32, round, scale): the decoder-only models' `RMSNorm`, so the device's fused ops apply."""


class T5Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, is_decoder: bool, has_relative_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.d_kv
        inner = self.num_heads * self.head_dim
        self.q = Linear(config.d_model, inner)
        self.k = Linear(config.d_model, inner)
        self.v = Linear(config.d_model, inner)
        self.o = Linear(inner, config.d_model)
        self.is_decoder = is_decoder
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        if has_relative_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.num_heads)

    def position_bias(
        self, query_len: int, key_len: int, device: torch.device, query_start: int = 0
    ) -> Tensor:  # -> [H, Lq, Lk]
        """The bias of queries at positions query_start.. over keys at 0..key_len-1."""
        query_pos = torch.arange(query_start, query_start + query_len, device=device)
        relative = torch.arange(key_len, device=device)[None, :] - query_pos[:, None]
        buckets = relative_position_bucket(
            relative, not self.is_decoder, self.num_buckets, self.max_distance
        )
        return self.relative_attention_bias(buckets).permute(2, 0, 1)

    def distance_bias(self, length: int, device: torch.device) -> Tensor:  # -> float32 [H, length]
        """A decoder query's bias over keys by distance, nearest last: column length - 1 - d is
        distance d (the paged decode kernel's layout, `cpu_ops.paged_decode_attention`)."""
        relative = torch.arange(1 - length, 1, device=device)
        buckets = relative_position_bucket(relative, False, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).t().float().contiguous()

    def heads(self, t: Tensor) -> Tensor:  # [L, H * D] -> [L, H, D]
        return t.view(t.shape[0], self.num_heads, self.head_dim)

    def forward(
        self, x: Tensor, kv_source: Tensor, bias: Tensor | None
    ) -> Tensor:  # [L, d], [M, d] -> [L, d]
        q, k, v = (
            self.heads(t).transpose(0, 1) for t in (self.q(x), self.k(kv_source), self.v(kv_source))
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(out.transpose(0, 1).reshape(x.shape[0], -1))


class T5DenseActDense(nn.Module):
    """`wo(act(wi(x)))`, or gated `wo(act(wi_0(x)) * wi_1(x))` (v1.1); HF's `DenseReluDense`."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gated = bool(getattr(config, "is_gated_act", False))
        if self.gated:
            self.wi_0 = Linear(config.d_model, config.d_ff)
            self.wi_1 = Linear(config.d_model, config.d_ff)
        else:
            self.wi = Linear(config.d_model, config.d_ff)
        self.wo = Linear(config.d_ff, config.d_model)
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
        self.add_module(
            name, module
        )  # HF's name for it: SelfAttention, EncDecAttention, DenseReluDense
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    @property
    def body(self) -> nn.Module:
        return getattr(self, self.name)


class T5Block(nn.Module):
    def __init__(self, config: PretrainedConfig, is_decoder: bool, has_relative_bias: bool) -> None:
        super().__init__()
        layers = [
            _SubLayer(config, "SelfAttention", T5Attention(config, is_decoder, has_relative_bias))
        ]
        if is_decoder:
            layers.append(_SubLayer(config, "EncDecAttention", T5Attention(config, True, False)))
        layers.append(_SubLayer(config, "DenseReluDense", T5DenseActDense(config)))
        self.layer = nn.ModuleList(layers)
        if is_decoder:
            self.cache = kv_holder(config.num_heads, config.d_kv)

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

    def flat(self, h: Tensor, segs: list[slice], biases: list[Tensor]) -> Tensor:
        """An encoder block over a flat batch of sources [S, d]: attention within each (its bias)."""
        self_layer, ff = self.layer
        sa, normed = self_layer.body, self_layer.layer_norm(h)
        q, k, v = (sa.heads(t) for t in (sa.q(normed), sa.k(normed), sa.v(normed)))
        normed, h = ff.layer_norm.add_and_norm(sa.o(attend_segments(q, k, v, segs, biases, 1.0)), h)
        return h + ff.body(normed)

    def paged(
        self,
        h: Tensor,
        plan: StepPlan,
        biases: list[Tensor],
        decode_bias: Tensor | None,
        slots: Tensor,
    ) -> Tensor:
        """A decoder block over the flat batch's rows [T, d] and the paged cache."""
        self_layer, cross_layer, ff = self.layer
        sa, ca = self_layer.body, cross_layer.body
        normed = self_layer.layer_norm(h)
        write_kv(self.cache, sa.heads(sa.k(normed)), sa.heads(sa.v(normed)), slots)
        out = paged_attention(
            self.cache, sa.heads(sa.q(normed)), plan, 1.0, False, biases, decode_bias
        )
        normed, h = cross_layer.layer_norm.add_and_norm(sa.o(out), h)  # (the sum may go into h)
        out = paged_attention(self.cache, ca.heads(ca.q(normed)), plan, 1.0, True, biases)
        normed, h = ff.layer_norm.add_and_norm(ca.o(out), h)
        return h + ff.body(normed)


class T5Stack(nn.Module):
    def __init__(
        self, config: PretrainedConfig, shared: VocabEmbedding, is_decoder: bool, num_layers: int
    ) -> None:
        super().__init__()
        self.embed_tokens = shared
        self.is_decoder = is_decoder
        self.block = nn.ModuleList(T5Block(config, is_decoder, i == 0) for i in range(num_layers))
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(
        self, input_ids: Tensor, encoder_out: Tensor | None = None
    ) -> Tensor:  # [L] -> [L, d]
        h = self.embed_tokens(input_ids)
        length = input_ids.shape[0]
        bias = (
            self.block[0].layer[0].body.position_bias(length, length, input_ids.device).to(h.dtype)
        )
        if self.is_decoder:  # causal: the future masked out of the shared bias
            future = torch.ones(length, length, dtype=torch.bool, device=h.device).triu(1)
            bias = bias.masked_fill(future, float("-inf"))
        for block in self.block:
            h = block(h, bias, encoder_out)
        return self.final_layer_norm(h)


class T5ForConditionalGeneration(nn.Module):
    """`shared`, `encoder`, `decoder`, and `lm_head` when the head is not tied (v1.1)."""

    is_encoder_decoder = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.shared = VocabEmbedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, self.shared, False, config.num_layers)
        self.decoder = T5Stack(
            config, self.shared, True, config.num_decoder_layers or config.num_layers
        )
        # v1.0 ties the head and scales the decoder output; v1.1 does neither (transformers >= 5 keeps
        # the distinction as `scale_decoder_outputs`, earlier versions as `tie_word_embeddings`)
        self.scale_decoder_outputs = bool(
            getattr(config, "scale_decoder_outputs", config.tie_word_embeddings)
        )
        self.tie_word_embeddings = (
            self.scale_decoder_outputs
        )  # (what the loader's packing and quantizer ask)
        if not self.scale_decoder_outputs:
            self.lm_head = Linear(config.d_model, config.vocab_size)
            # checkpoints of Google's have the head; transformers >= 5 ties it and saves none
            self.tied_fallbacks = {"lm_head.weight": "shared.weight"}

    def encode(self, input_ids: Tensor) -> Tensor:  # [S] -> [S, d]
        return self.encoder(input_ids)

    def decode(self, decoder_ids: Tensor, encoder_out: Tensor) -> Tensor:  # [T], [S, d] -> [T, d]
        return self.decoder(decoder_ids, encoder_out)

    def encode_into_cache(
        self, input_ids: Tensor, cu_seqlens: list[int], cross_slots: Tensor
    ) -> None:
        """Encode a flat batch of sources (request i: rows cu[i]:cu[i+1]) and write each decoder
        block's cross-attention K/V of them into the cache at `cross_slots` [S]."""
        # one flat batch: the matrices over every source's rows at once, attention within each
        segs = list(segments(cu_seqlens))
        table = self.encoder.block[0].layer[0].body
        encoded = self.shared(input_ids)
        biases = [
            table.position_bias(
                rows.stop - rows.start, rows.stop - rows.start, input_ids.device
            ).to(encoded.dtype)
            for rows in segs
        ]
        for block in self.encoder.block:
            encoded = block.flat(encoded, segs, biases)
        encoded = self.encoder.final_layer_norm(encoded)
        for block in self.decoder.block:
            ca = block.layer[1].body
            write_kv(block.cache, ca.heads(ca.k(encoded)), ca.heads(ca.v(encoded)), cross_slots)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, d]
        """The decoder over the step's flat batch and the paged cache (inside `forward_context`):
        each request's relative bias (rows at its new positions, the future masked) is shared
        by every block, as in the dense stack."""
        meta = current_context().meta
        plan = step_plan(meta, input_ids.device, uses_kernels(self.decoder.block[0].cache))
        table = self.decoder.block[0].layer[0].body
        h = self.shared(input_ids)
        biases = [
            (
                table.position_bias(r.query_len, r.seq_len, h.device, r.seq_len - r.query_len)
                + r.causal_mask(h.device)
            ).to(h.dtype)
            for r in plan.prefill
        ]
        decode_bias = None
        if plan.kernels:  # the kernel's table by distance from the query, for every row
            decode_bias = table.distance_bias(max(r.seq_len for r in plan.rows), h.device)
        elif (
            plan.decode_index is not None
        ):  # each decode row's bias over the padded keys, its mask added
            keys = plan.self_mask.shape[-1]
            relative = torch.arange(keys, device=h.device)[None, :] - (plan.self_lens - 1)[:, None]
            buckets = relative_position_bucket(
                relative, False, table.num_buckets, table.max_distance
            )
            decode_bias = (
                table.relative_attention_bias(buckets).permute(0, 2, 1)[:, :, None, :]
                + plan.self_mask
            ).to(h.dtype)
        for block in self.decoder.block:
            h = block.paged(h, plan, biases, decode_bias, meta.slot_mapping)
        return self.decoder.final_layer_norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, d] -> [N, vocab]
        if self.scale_decoder_outputs:
            return self.shared.lm_head(hidden * self.config.d_model**-0.5)
        return self.lm_head(hidden)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; copies of the shared table are skipped."""
        if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            return None
        if name == "lm_head.weight" and self.scale_decoder_outputs:
            return None
        return name

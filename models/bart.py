"""BART, mBART and Marian encoder-decoders with HF parameter names.

An encoder reads the source with bidirectional self-attention; each decoder layer attends
causally to the target so far and then to all encoder outputs (cross-attention). The families
differ in their embeddings and norms: BART adds learned positions (row p + 2 for position p) and
a layer norm over the embeddings; Marian adds fixed sinusoidal positions and scales the token
embeddings by sqrt(d_model); all add `final_logits_bias` to the logits. BART's and Marian's layers
are post-LN (the residual is added, then normalized); mBART's are pre-LN, and each of its stacks
ends with one more layer norm.

Two forwards: `encode` / `decode` are the dense oracle (one request, no KV cache: `decode`
recomputes the whole target prefix); `encode_into_cache` + `forward` are what the engine runs
(a flat batch of requests over the paged cache, models/seq2seq.py), checked against the oracle
and transformers. Shapes: S = source tokens, T = target tokens, d = d_model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.models.attention.metadata import current_context
from kvserve.models.layers import Linear, VocabEmbedding, get_activation
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


def sinusoidal_positions(num_positions: int, dim: int) -> Tensor:
    """Marian's table: sin of even-indexed angles in the first half of the row, cos of the odd
    ones in the second half (angle j of position p: p / 10000 ** (2 * (j // 2) / dim))."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    j = torch.arange(dim, dtype=torch.float64)[None, :]
    angles = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)
    half = (dim + 1) // 2
    table = torch.empty(num_positions, dim, dtype=torch.float64)
    table[:, :half] = torch.sin(angles[:, 0::2])
    table[:, half:] = torch.cos(angles[:, 1::2])
    return table.float()


class Seq2SeqAttention(nn.Module):
    """Multi-head attention with q/k/v/out projections (biased), query scaled by head_dim ** -0.5."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = Linear(dim, dim, bias=True)
        self.k_proj = Linear(dim, dim, bias=True)
        self.v_proj = Linear(dim, dim, bias=True)
        self.out_proj = Linear(dim, dim, bias=True)

    def heads(self, t: Tensor) -> Tensor:  # [L, d] -> [L, H, D]
        return t.view(t.shape[0], self.num_heads, self.head_dim)

    def flat(self, x: Tensor, segs: list[slice]) -> Tensor:  # [S, d] -> [S, d], within each request
        q, k, v = (self.heads(t) for t in (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
        return self.out_proj(attend_segments(q, k, v, segs, [None] * len(segs), None))

    def forward(
        self, x: Tensor, kv_source: Tensor, causal: bool
    ) -> Tensor:  # [L, d], [M, d] -> [L, d]
        q, k, v = (
            self.heads(t).transpose(0, 1)
            for t in (self.q_proj(x), self.k_proj(kv_source), self.v_proj(kv_source))
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class _Residual(nn.Module):
    """A layer whose sub-layers add to the residual stream post-norm (BART, Marian: normalize the
    sum) or pre-norm (mBART: normalize the sub-layer's input)."""

    pre_norm = False

    def sub(self, h: Tensor, norm: nn.Module, body) -> Tensor:
        return h + body(norm(h)) if self.pre_norm else norm(h + body(h))

    def ffn(self, h: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(h)))


class EncoderLayer(_Residual):
    def __init__(self, config: PretrainedConfig, pre_norm: bool = False) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        d = config.d_model
        self.self_attn = Seq2SeqAttention(d, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, config.encoder_ffn_dim, bias=True)
        self.fc2 = Linear(config.encoder_ffn_dim, d, bias=True)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = get_activation(config.activation_function)

    def forward(
        self, h: Tensor, segs: list[slice] | None = None
    ) -> Tensor:  # segs: a flat batch's requests
        attention = (
            (lambda x: self.self_attn(x, x, causal=False))
            if segs is None
            else (lambda x: self.self_attn.flat(x, segs))
        )
        h = self.sub(h, self.self_attn_layer_norm, attention)
        return self.sub(h, self.final_layer_norm, self.ffn)


class DecoderLayer(_Residual):
    def __init__(self, config: PretrainedConfig, pre_norm: bool = False) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        d = config.d_model
        self.self_attn = Seq2SeqAttention(d, config.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = Seq2SeqAttention(d, config.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, config.decoder_ffn_dim, bias=True)
        self.fc2 = Linear(config.decoder_ffn_dim, d, bias=True)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = get_activation(config.activation_function)
        self.cache = kv_holder(config.decoder_attention_heads, d // config.decoder_attention_heads)

    def forward(self, h: Tensor, encoder_out: Tensor) -> Tensor:
        h = self.sub(h, self.self_attn_layer_norm, lambda x: self.self_attn(x, x, causal=True))
        h = self.sub(
            h,
            self.encoder_attn_layer_norm,
            lambda x: self.encoder_attn(x, encoder_out, causal=False),
        )
        return self.sub(h, self.final_layer_norm, self.ffn)

    def paged(self, h: Tensor, plan: StepPlan, masks: list[Tensor], slots: Tensor) -> Tensor:
        """The flat batch's rows [T, d] through this layer over the paged cache."""
        sa, ca = self.self_attn, self.encoder_attn

        def self_attention(x: Tensor) -> Tensor:
            write_kv(self.cache, sa.heads(sa.k_proj(x)), sa.heads(sa.v_proj(x)), slots)
            return sa.out_proj(
                paged_attention(self.cache, sa.heads(sa.q_proj(x)), plan, sa.scale, False, masks)
            )

        def cross_attention(x: Tensor) -> Tensor:
            return ca.out_proj(
                paged_attention(self.cache, ca.heads(ca.q_proj(x)), plan, ca.scale, True, masks)
            )

        h = self.sub(h, self.self_attn_layer_norm, self_attention)
        h = self.sub(h, self.encoder_attn_layer_norm, cross_attention)
        return self.sub(h, self.final_layer_norm, self.ffn)


class Stack(nn.Module):
    """An encoder or a decoder: embeddings (tokens, positions, optional layer norm) and layers."""

    def __init__(
        self,
        config: PretrainedConfig,
        shared: VocabEmbedding,
        layer_cls: type[nn.Module],
        num_layers: int,
        sinusoidal: bool,
        pre_norm: bool = False,
    ) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = shared
        self.embed_scale = math.sqrt(d) if getattr(config, "scale_embedding", False) else 1.0
        self.sinusoidal = sinusoidal
        if sinusoidal:  # fixed, not loaded (see `map_weight_name`)
            self.register_buffer(
                "positions",
                sinusoidal_positions(config.max_position_embeddings, d),
                persistent=False,
            )
        else:  # BART's learned table is offset by 2 rows
            self.embed_positions = nn.Embedding(config.max_position_embeddings + 2, d)
        self.dim, self.num_positions = d, config.max_position_embeddings
        if not sinusoidal:
            self.layernorm_embedding = nn.LayerNorm(d)
        self.layers = nn.ModuleList(layer_cls(config, pre_norm) for _ in range(num_layers))
        if pre_norm:  # mBART: the stack's output normalized once more
            self.layer_norm = nn.LayerNorm(d)

    def final_norm(self, h: Tensor) -> Tensor:
        return self.layer_norm(h) if hasattr(self, "layer_norm") else h

    def reset_buffers(self) -> None:
        """After the loader made the buffers on the device (uninitialized): the fixed table again."""
        if self.sinusoidal:
            self.positions.copy_(sinusoidal_positions(self.num_positions, self.dim))

    def embed(self, input_ids: Tensor, positions: Tensor | None = None) -> Tensor:  # [L] -> [L, d]
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        h = self.embed_tokens(input_ids) * self.embed_scale
        if self.sinusoidal:
            return h + self.positions[positions].to(h.dtype)
        return self.layernorm_embedding(h + self.embed_positions(positions + 2))


class BartForConditionalGeneration(nn.Module):
    """The model (`model.shared`, `model.encoder`, `model.decoder`), `lm_head` and `final_logits_bias`."""

    sinusoidal_positions = False
    pre_norm = False
    is_encoder_decoder = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.shared = VocabEmbedding(config.vocab_size, config.d_model)
        decoder_embed = self.model.shared
        if not getattr(
            config, "share_encoder_decoder_embeddings", True
        ):  # Marian's separate vocabularies
            decoder_embed = VocabEmbedding(
                getattr(config, "decoder_vocab_size", None) or config.vocab_size, config.d_model
            )
        self.model.encoder = Stack(
            config,
            self.model.shared,
            EncoderLayer,
            config.encoder_layers,
            self.sinusoidal_positions,
            self.pre_norm,
        )
        self.model.decoder = Stack(
            config,
            decoder_embed,
            DecoderLayer,
            config.decoder_layers,
            self.sinusoidal_positions,
            self.pre_norm,
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.d_model, decoder_embed.weight.shape[0])
        self.register_buffer("final_logits_bias", torch.zeros(1, decoder_embed.weight.shape[0]))

    def encode(self, input_ids: Tensor) -> Tensor:  # [S] -> [S, d]
        h = self.model.encoder.embed(input_ids)
        for layer in self.model.encoder.layers:
            h = layer(h)
        return self.model.encoder.final_norm(h)

    def decode(self, decoder_ids: Tensor, encoder_out: Tensor) -> Tensor:  # [T], [S, d] -> [T, d]
        h = self.model.decoder.embed(decoder_ids)
        for layer in self.model.decoder.layers:
            h = layer(h, encoder_out)
        return self.model.decoder.final_norm(h)

    def encode_into_cache(
        self, input_ids: Tensor, cu_seqlens: list[int], cross_slots: Tensor
    ) -> None:
        """Encode a flat batch of sources (request i: rows cu[i]:cu[i+1]) and write each decoder
        layer's cross-attention K/V of them into the cache at `cross_slots` [S]."""
        # one flat batch: the matrices over every source's rows at once, attention within each
        segs = list(segments(cu_seqlens))
        positions = torch.cat(
            [torch.arange(rows.stop - rows.start, device=input_ids.device) for rows in segs]
        )
        encoded = self.model.encoder.embed(input_ids, positions)
        for layer in self.model.encoder.layers:
            encoded = layer(encoded, segs)
        encoded = self.model.encoder.final_norm(encoded)
        for layer in self.model.decoder.layers:
            ca = layer.encoder_attn
            write_kv(
                layer.cache, ca.heads(ca.k_proj(encoded)), ca.heads(ca.v_proj(encoded)), cross_slots
            )

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, d]
        """The decoder over the step's flat batch and the paged cache (inside `forward_context`)."""
        meta = current_context().meta
        plan = step_plan(meta, input_ids.device, uses_kernels(self.model.decoder.layers[0].cache))
        masks = [r.causal_mask(input_ids.device) for r in plan.prefill]
        h = self.model.decoder.embed(input_ids, positions)
        for layer in self.model.decoder.layers:
            h = layer.paged(h, plan, masks, meta.slot_mapping)
        return self.model.decoder.final_norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, d] -> [N, vocab]
        logits = (
            self.model.decoder.embed_tokens.lm_head(hidden)
            if self.tie_word_embeddings
            else self.lm_head(hidden)
        )
        return logits + self.final_logits_bias[0].to(logits.dtype)

    def reset_buffers(self) -> None:
        """After the loader made the buffers (uninitialized): zero, unless the checkpoint has one."""
        self.final_logits_bias.zero_()

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> parameter or buffer name; None skips copies of tied tables and fixed positions."""
        tied = {"model.encoder.embed_tokens.weight"}
        if getattr(self.config, "share_encoder_decoder_embeddings", True):
            tied.add("model.decoder.embed_tokens.weight")
        if self.tie_word_embeddings:
            tied.add("lm_head.weight")
        if name in tied or (self.sinusoidal_positions and ".embed_positions." in name):
            return None
        return name


class MarianMTModel(BartForConditionalGeneration):
    """Marian: BART's layers with sinusoidal positions and scaled embeddings, no embedding norm."""

    sinusoidal_positions = True


class MBartForConditionalGeneration(BartForConditionalGeneration):
    """mBART: BART's embeddings with pre-norm layers and a final layer norm on each stack."""

    pre_norm = True

"""GPT-2 with HF parameter names (`transformer.h.{i}.attn.c_attn`, ...).

Quirks owned here:
* HF stores GPT-2's projections as `Conv1D` with weights [in, out]; we keep the
  usual [out, in] layout and transpose explicitly when loading (before a
  tensor-parallel layer takes its rank's slice: models/parallel.py).
* Learned absolute position embeddings (`wpe`), LayerNorm, `gelu_new`.
* The LM head is tied to `wte` (unless `tie_word_embeddings` is False).
* Checkpoints from the original OpenAI upload have no `transformer.` prefix and
  carry the causal-mask buffers `attn.bias` / `attn.masked_bias`, which are skipped.

Shapes: T = tokens in the flat batch, n = n_embd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvserve.models.attention import Attention
from kvserve.models.layers import VocabEmbedding, as_lazy, default_weight_loader, get_activation
from kvserve.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def from_conv1d(layer: nn.Module) -> nn.Module:
    """Make `layer` load HF Conv1D weights [in, out]: its own loader gets the [out, in] view
    (read lazily, so a tensor-parallel rank still reads only its slice); biases as they are."""
    for param in layer.parameters():
        load = param.weight_loader

        @torch.no_grad()
        def conv1d_loader(p: Tensor, loaded, *shard_id, _load=load) -> None:
            try:
                _load(p, as_lazy(loaded).t(), *shard_id)
            except ValueError as e:
                raise ValueError(f"{e} (Conv1D weight, after transpose)") from None

        param.weight_loader = conv1d_loader
    return layer


class LayerNorm(nn.LayerNorm):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__(n, eps=eps)
        self.weight.weight_loader = default_weight_loader
        self.bias.weight_loader = default_weight_loader


class GPT2Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        n, num_heads = config.n_embd, config.n_head
        head_dim = n // num_heads
        scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.n = n
        # q, k, v already packed in this order; each rank takes its heads of each
        self.c_attn = from_conv1d(QKVParallelLinear(n, head_dim, num_heads, num_heads, bias=True))
        self.c_proj = from_conv1d(RowParallelLinear(n, n, bias=True))
        local_heads = self.c_attn.num_heads
        self.attn = Attention(local_heads, local_heads, head_dim, scale=scale)

    def forward(self, x: Tensor) -> Tensor:  # [T, n] -> [T, n]
        return self.c_proj(self.attn(self.c_attn(x)))  # c_attn: q, k, v packed [T, 3n / tp]


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = from_conv1d(ColumnParallelLinear(config.n_embd, inner, bias=True))
        self.c_proj = from_conv1d(RowParallelLinear(inner, config.n_embd, bias=True))
        self.act = get_activation(config.activation_function)

    def forward(self, x: Tensor) -> Tensor:  # [T, n] -> [T, n]
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd)
        self.wpe = VocabEmbedding(config.n_positions, config.n_embd)  # small: every rank has it all
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, n]
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    packed_modules_mapping: dict = {}  # c_attn is already packed in the checkpoint

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.n_embd, config.vocab_size)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, n]
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, n] -> [N, vocab]
        if self.tie_word_embeddings:
            return self.transformer.wte.lm_head(hidden)
        return self.lm_head(hidden)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> module name; None skips mask buffers and a tied head's copy."""
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings else name
        return name if name.startswith("transformer.") else "transformer." + name

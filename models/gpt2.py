"""GPT-2 with HF parameter names (`transformer.h.{i}.attn.c_attn`, ...).

Quirks owned here:
* HF stores GPT-2's projections as `Conv1D` with weights [in, out]; we keep the
  usual [out, in] layout and transpose explicitly when loading.
* Learned absolute position embeddings (`wpe`), LayerNorm, `gelu_new`.
* The LM head is tied to `wte` (unless `tie_word_embeddings` is False).
* Checkpoints from the original OpenAI upload have no `transformer.` prefix and
  carry the causal-mask buffers `attn.bias` / `attn.masked_bias`, which are skipped.

Shapes: T = tokens in the flat batch, n = n_embd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import Attention
from models.layers import Linear, VocabEmbedding, check_shape, default_weight_loader, get_activation

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@torch.no_grad()
def conv1d_weight_loader(param: Tensor, loaded: Tensor) -> None:
    """HF Conv1D weight [in, out] -> our Linear weight [out, in]; biases are copied as-is."""
    if loaded.dim() == 2:
        loaded = loaded.t()
    check_shape(param, loaded, " (Conv1D weight, after transpose)" if loaded.dim() == 2 else "")
    param.copy_(loaded)


class Conv1DLinear(Linear):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=True)
        self.weight.weight_loader = conv1d_weight_loader
        self.bias.weight_loader = conv1d_weight_loader


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
        self.c_attn = Conv1DLinear(n, 3 * n)  # q, k, v already packed in this order
        self.c_proj = Conv1DLinear(n, n)
        self.attn = Attention(num_heads, num_heads, head_dim, scale=scale)

    def forward(self, x: Tensor) -> Tensor:  # [T, n] -> [T, n]
        return self.c_proj(self.attn(self.c_attn(x)))  # c_attn: q, k, v packed [T, 3n]


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = Conv1DLinear(config.n_embd, inner)
        self.c_proj = Conv1DLinear(inner, config.n_embd)
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
        self.wte = VocabEmbedding(config.vocab_size, config.n_embd)
        self.wpe = VocabEmbedding(config.n_positions, config.n_embd)
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
            self.lm_head = Linear(config.n_embd, config.vocab_size)

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

"""Llama-family decoder (Llama 1/2/3, Mistral) with HF parameter names.

Packed weights: q/k/v live in one `qkv_proj` and gate/up in one `gate_up_proj`
(see `packed_modules_mapping`). Qwen2/Qwen3 reuse this file's blocks (`qwen.py`).
The linears are tensor-parallel ones (models/parallel.py): with tensor parallelism each
rank holds its heads and its slice of the MLP; at size 1 they are plain linears.

Shapes: T = tokens in the flat batch, H/KvH = this rank's query/KV heads, D = head_dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from kvserve.models.attention import Attention
from kvserve.models.fused_ops import TORCH_OPS, FusedOps
from kvserve.models.layers import RMSNorm, RotaryEmbedding, get_activation, rope_parameters
from kvserve.models.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_for_layer(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The layer's sliding window as HF applies it, or None for full attention.

    transformers >= 5 marks layers in `config.layer_types`; older Qwen2 configs use
    `use_sliding_window` + `max_window_layers`; Mistral applies `sliding_window` everywhere.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if hasattr(config, "use_sliding_window"):
        use = config.use_sliding_window and layer_idx >= getattr(config, "max_window_layers", 0)
        return window if use else None
    return window


class LlamaAttention(nn.Module):
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None

    def __init__(
        self, config: PretrainedConfig, layer_idx: int, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        default_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = default_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = default_bias if self.o_bias is None else self.o_bias
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = (
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
        )  # this rank's
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=o_bias)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=sliding_window_for_layer(config, layer_idx),
            rotary=rotary_emb,  # applied to q and k by the attention backend
        )

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KvH) * D]
        return self.o_proj(self.attn(qkv))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], [0, 1], bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        act = getattr(config, "hidden_act", "silu")
        self.act = None if act == "silu" else get_activation(act)
        self.ops: FusedOps = TORCH_OPS  # the device's, set at load

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate / tp]
        if self.act is None:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        attention_cls: type[nn.Module],
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """x: the previous layer's MLP output (or the embeddings, with residual None), not yet
        added to the residual stream -> this layer's (MLP output, residual stream), [T, hidden]
        each. Deferring each add to the next norm lets one fused op do both."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(h), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attention_cls: type[nn.Module],
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        if rotary_emb is None:
            rotary_emb = RotaryEmbedding(
                head_dim_of(config), config.max_position_embeddings, rope_parameters(config)
            )
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attention_cls, self.rotary_emb)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, hidden]
        # (positions reach the rotary embedding through the attention metadata)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer.forward(
                x, residual
            )  # skips nn.Module's hook dispatch, a real share of a batch-1 step
        return self.norm.add_and_norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head; `lm_head` is the embedding matrix when `tie_word_embeddings`."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_cls, self.rotary_embedding(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def rotary_embedding(self, config: PretrainedConfig) -> RotaryEmbedding | None:
        """The rotary embedding every layer shares; None: LlamaModel's (the config's rope type)."""
        return None

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab] (on rank 0)
        if self.tie_word_embeddings:
            return self.model.embed_tokens.lm_head(hidden)
        return self.lm_head(hidden)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> this module's name (before packing); None skips the tensor."""
        if name.endswith("rotary_emb.inv_freq"):  # a buffer that old checkpoints saved
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # some tied checkpoints store a copy of the embedding
        return name


class BaseModelMixin:
    """A bare decoder checkpoint (`LlamaModel`, `Qwen3Model`: what sentence-transformers and
    `AutoModel.save_pretrained` write): the decoder's weights without the `model.` prefix and no LM
    head. It serves embeddings; `compute_logits` reads the embedding matrix (warm-up runs it)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.tie_word_embeddings = True
        if "lm_head" in self._modules:  # an untied config's head: no such weights in the checkpoint
            del self.lm_head

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith("lm_head."):
            return None
        return super().map_weight_name(name if name.startswith("model.") else f"model.{name}")


class LlamaModelForEmbedding(BaseModelMixin, LlamaForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer (`config.sliding_window`, may be null)."""

"""Gemma 2 and Gemma 3 (text) decoders with HF parameter names.

What sets them apart from Llama (models/llama.py), each matched to transformers:
* RMSNorm scales by `(1 + weight)`, computed in fp32 and rounded once. The `+ 1` is folded in
  at load, in fp32 (`GemmaRMSNorm`): HF computes the same fp32 value each call. Four norms per
  layer: before and after attention, before and after the MLP (the residual adds follow the
  post-norms).
* GeGLU MLP (`hidden_activation`, gelu with the tanh approximation), embeddings multiplied by
  sqrt(hidden) rounded to the embedding dtype, query scale `query_pre_attn_scalar ** -0.5`.
* Sliding-window and global layers interleaved per `config.layer_types`.
* Gemma 2: attention-logit soft-capping (`attn_logit_softcapping`, done by the attention backend)
  and final-logit soft-capping (`final_logit_softcapping`, here in `compute_logits`).
* Gemma 3: per-head q/k norms before rotary, and two rotary tables: `rope_local_base_freq`
  (sliding layers) and `rope_theta` with `rope_scaling` (global layers).
`Gemma3ForConditionalGeneration` (the multimodal checkpoints) serves the text part only.

Shapes: T = tokens in the flat batch, H/KvH = this rank's query/KV heads, D = head_dim.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.models.attention import Attention
from kvserve.models.layers import (
    LazyTensor,
    RotaryEmbedding,
    as_lazy,
    check_shape,
    get_activation,
    rope_parameters,
)
from kvserve.models.llama import head_dim_of
from kvserve.models.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


class GemmaRMSNorm(nn.Module):
    """HF Gemma's RMSNorm: `(norm(x.float()) * (1 + weight.float())).to(x.dtype)`.

    The weight is kept in fp32 with the 1 already added (`fl32(1 + w)`, the very value HF
    computes each call), so in bf16 the output is rounded once, as HF's is. A GGUF file stores
    `1 + w` already; the GGUF reader hands it back as `w` (models/gguf_loader.py), and adding 1
    again in fp32 restores its value exactly.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.weight.stage_dtype = (
            torch.float32
        )  # the loader allocates it in fp32 whatever the model dtype
        self.weight.weight_loader = self.weight_loader
        self.eps = eps

    @staticmethod
    @torch.no_grad()
    def weight_loader(param: Tensor, loaded: Tensor | LazyTensor) -> None:
        check_shape(param, loaded)
        param.copy_(as_lazy(loaded).read().float() + 1.0)

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden] -> [..., hidden]
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)

    def norm_heads_(self, heads: Tensor) -> None:
        """The norm of each head of heads [T, H, D] (a view into qkv: Gemma 3's q/k norms), in place."""
        heads.copy_(self(heads))


def _rope_for_layer_type(config: PretrainedConfig, layer_type: str) -> dict:
    """The rotary settings of `layer_type` layers: transformers 5 keeps one dict per layer type
    (Gemma 3), 4.x `rope_local_base_freq` for sliding layers; Gemma 2 has one for all."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        params = dict(params[layer_type])
        params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
        params.setdefault("rope_theta", 10000.0)
        return params
    local_base = getattr(config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local_base is not None:
        return {"rope_type": "default", "rope_theta": float(local_base)}
    return rope_parameters(config)


def layer_types_of(config: PretrainedConfig) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention": `layer_types`, else HF's default
    pattern (every `sliding_window_pattern`-th layer global; 2 for Gemma 2, 6 for Gemma 3)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"config.layer_types has {len(layer_types)} entries for {config.num_hidden_layers} layers"
            )
        return list(layer_types)
    default = 2 if getattr(config, "model_type", "") == "gemma2" else 6
    pattern = getattr(config, "sliding_window_pattern", None) or default
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(config.num_hidden_layers)
    ]


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        is_sliding: bool,
        rotary_emb: RotaryEmbedding,
        has_qk_norm: bool,
    ) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias)
        self.num_heads, self.num_kv_heads = (
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
        )  # this rank's
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=bias)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=config.sliding_window if is_sliding else None,
            rotary=rotary_emb,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
        )
        if has_qk_norm:
            self.q_norm = GemmaRMSNorm(
                self.head_dim, eps=config.rms_norm_eps
            )  # shared by all query heads
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.has_qk_norm = has_qk_norm

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KvH) * D]
        if self.has_qk_norm:
            q, k, _ = self.attn.split_qkv(qkv)
            self.q_norm.norm_heads_(q)  # per head, before the rotary embedding; in place in qkv
            self.k_norm.norm_heads_(k)
        return self.o_proj(self.attn(qkv))


class GemmaMLP(nn.Module):
    """GeGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], [0, 1], False)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False)
        act = getattr(config, "hidden_activation", None) or getattr(
            config, "hidden_act", "gelu_pytorch_tanh"
        )
        self.act = get_activation(act)

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate / tp] each
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        is_sliding: bool,
        rotary_emb: RotaryEmbedding,
        has_qk_norm: bool,
    ) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, is_sliding, rotary_emb, has_qk_norm)
        self.mlp = GemmaMLP(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, has_qk_norm: bool) -> None:
        super().__init__()
        if getattr(
            config, "use_bidirectional_attention", False
        ):  # e.g. EmbeddingGemma: not a causal LM
            raise ValueError(
                "use_bidirectional_attention=True (an encoder, not a causal decoder) is not supported"
            )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) as HF multiplies by it: a tensor of the embedding dtype (bf16 rounds it)
        self.embed_scales = {
            dtype: float(torch.tensor(config.hidden_size**0.5, dtype=dtype, device="cpu"))
            for dtype in (torch.float32, torch.bfloat16, torch.float16)
        }
        head_dim = head_dim_of(config)
        layer_types = layer_types_of(config)
        # one rotary table per layer type (Gemma 2's are equal; a shared module computes once per step)
        rotary = {
            t: RotaryEmbedding(
                head_dim, config.max_position_embeddings, _rope_for_layer_type(config, t)
            )
            for t in dict.fromkeys(layer_types)
        }
        if (
            len(rotary) > 1
            and rotary["sliding_attention"].params == rotary["full_attention"].params
        ):
            rotary["sliding_attention"] = rotary["full_attention"]
        self.rotary_embs = nn.ModuleList(dict.fromkeys(rotary.values()))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, t == "sliding_attention", rotary[t], has_qk_norm)
            for t in layer_types
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, hidden]
        # (positions reach the rotary embeddings through the attention metadata)
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scales[x.dtype]
        for layer in self.layers:
            x = layer.forward(x)
        return self.norm(x)


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2 decoder + LM head (the embedding matrix when `tie_word_embeddings`, as Gemma is)."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    has_qk_norm = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, self.has_qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:  # [T], [T] -> [T, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab] (on rank 0)
        logits = (
            self.model.embed_tokens.lm_head(hidden)
            if self.tie_word_embeddings
            else self.lm_head(hidden)
        )
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> this module's name (before packing); None skips the tensor."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # some tied checkpoints store a copy of the embedding
        return name


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    has_qk_norm = True


_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text decoder of a multimodal Gemma 3 checkpoint; its vision tower is not loaded.

    The config nests the decoder's under `text_config`; the weights are `model.language_model.*`
    and `lm_head.weight` (transformers 5) or `language_model.model.*` and `language_model.lm_head.weight`
    (checkpoints saved by transformers 4)."""

    def __init__(self, config: PretrainedConfig) -> None:
        text_config = getattr(config, "text_config", None) or config
        super().__init__(text_config)
        logger.info(
            "Gemma3ForConditionalGeneration: serving the text decoder only; the vision tower "
            "and its projector are not loaded (image inputs are not supported)"
        )

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, to in (
            ("model.language_model.", "model."),
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
        ):
            if name.startswith(prefix):
                name = to + name[len(prefix) :]
                break
        return super().map_weight_name(name)

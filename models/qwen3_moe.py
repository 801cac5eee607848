"""Qwen3-MoE decoder (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms, explicit head_dim)
with a sparse mixture-of-experts MLP (models/moe.py) on most layers.

A layer is sparse when it is not in `mlp_only_layers` and `(layer + 1) % decoder_sparse_step == 0`
(transformers' rule); the others keep Qwen3's dense MLP of `intermediate_size`. Experts have
`moe_intermediate_size`; the top-k routing weights are renormalized only with `norm_topk_prob`
and rounded to the model dtype, as transformers does. No shared expert (Qwen2-MoE has one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import SparseMoeBlock, moe_weight_name
from kvserve.models.qwen import Qwen3Attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig

QWEN_EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Built as a Qwen3 model whose sparse layers then get a `SparseMoeBlock` as their `mlp`
    (the dense MLPs replaced were built on the meta device: nothing is allocated for them)."""

    attention_cls = Qwen3Attention

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            if is_sparse_layer(config, i):
                layer.mlp = SparseMoeBlock(
                    config.num_experts,
                    config.num_experts_per_tok,
                    config.hidden_size,
                    config.moe_intermediate_size,
                    getattr(config, "hidden_act", "silu"),
                    renormalize=bool(getattr(config, "norm_topk_prob", False)),
                    weights_in_model_dtype=True,
                )

    def map_weight_name(self, name: str) -> str | tuple[str, tuple[int, int]] | None:
        name = super().map_weight_name(name)
        return None if name is None else moe_weight_name(name, ".mlp.experts.", QWEN_EXPERT_PARTS)

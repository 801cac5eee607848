"""Qwen2-MoE decoder (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v bias) with a sparse
mixture-of-experts MLP (models/moe.py) plus a shared expert on the sparse layers.

The shared expert is a dense MLP of `shared_expert_intermediate_size` that every token runs,
scaled by sigmoid(`shared_expert_gate`(x)) and added to the routed experts' sum, as transformers
does. Sparse layers, routing and weight names are Qwen3-MoE's (models/qwen3_moe.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import SparseMoeBlock, moe_weight_name
from kvserve.models.qwen import Qwen2Attention
from kvserve.models.qwen3_moe import QWEN_EXPERT_PARTS, is_sparse_layer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Built as a Qwen2 model whose sparse layers then get a `SparseMoeBlock` with a shared expert
    (the dense MLPs replaced were built on the meta device: nothing is allocated for them)."""

    attention_cls = Qwen2Attention

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
                    shared_intermediate_size=config.shared_expert_intermediate_size,
                )

    def map_weight_name(self, name: str) -> str | tuple[str, tuple[int, int]] | None:
        name = super().map_weight_name(name)
        return None if name is None else moe_weight_name(name, ".mlp.experts.", QWEN_EXPERT_PARTS)

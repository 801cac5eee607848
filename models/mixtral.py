"""Mixtral decoder (`MixtralForCausalLM`): Mistral's attention with a sparse mixture-of-experts
MLP (models/moe.py) on every layer.

Routing as transformers does it: softmax in fp32, top-k, the k weights renormalized to sum to
one and kept in fp32 (each expert's output is scaled in fp32, then rounded to the model dtype).
Checkpoints name the block `block_sparse_moe` and the experts' matrices `w1` (gate), `w3` (up)
and `w2` (down); transformers >= 5's module layout (`mlp.experts.gate_up_proj`) loads too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import SparseMoeBlock, moe_weight_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MIXTRAL_EXPERT_PARTS = {
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


class MixtralForCausalLM(LlamaForCausalLM):
    """Built as a Mistral model whose MLPs are then replaced by `SparseMoeBlock`s (the dense ones
    were built on the meta device: nothing is allocated for them)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = SparseMoeBlock(
                config.num_local_experts,
                config.num_experts_per_tok,
                config.hidden_size,
                config.intermediate_size,
                getattr(config, "hidden_act", "silu"),
                renormalize=True,
                weights_in_model_dtype=False,
            )

    def map_weight_name(self, name: str) -> str | tuple[str, tuple[int, int]] | None:
        name = super().map_weight_name(name)
        if name is None:
            return None
        return moe_weight_name(
            name.replace(".block_sparse_moe.", ".mlp."), ".mlp.experts.", MIXTRAL_EXPERT_PARTS
        )

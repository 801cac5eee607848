"""Maps `config.architectures[0]` to the model class, so the runner never names a model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from kvserve.models.bart import (
    BartForConditionalGeneration,
    MarianMTModel,
    MBartForConditionalGeneration,
)
from kvserve.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from kvserve.models.gpt2 import GPT2LMHeadModel
from kvserve.models.llama import LlamaForCausalLM, LlamaModelForEmbedding, MistralForCausalLM
from kvserve.models.mixtral import MixtralForCausalLM
from kvserve.models.phi3 import Phi3ForCausalLM
from kvserve.models.qwen import (
    Qwen2ForCausalLM,
    Qwen2ModelForEmbedding,
    Qwen3ForCausalLM,
    Qwen3ModelForEmbedding,
)
from kvserve.models.qwen2_moe import Qwen2MoeForCausalLM
from kvserve.models.qwen3_moe import Qwen3MoeForCausalLM
from kvserve.models.t5 import T5ForConditionalGeneration

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # the text decoder only
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # mixture of experts (models/moe.py)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    # bare decoders without an LM head (sentence-transformers' embedding checkpoints): embeddings only
    "LlamaModel": LlamaModelForEmbedding,
    "Qwen2Model": Qwen2ModelForEmbedding,
    "Qwen3Model": Qwen3ModelForEmbedding,
    # encoder-decoders (models/seq2seq.py): CPU, PyTorch attention, no tensor parallelism yet
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "MarianMTModel": MarianMTModel,
    "MBartForConditionalGeneration": MBartForConditionalGeneration,
    "T5ForConditionalGeneration": T5ForConditionalGeneration,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)

# sentence-transformers checkpoints of a causal LM (Qwen3-Embedding names Qwen3ForCausalLM) hold the bare
# decoder's weights, often without the `model.` prefix and without an LM head: load them headless
_BARE_FOR_EMBEDDING = {
    "LlamaForCausalLM": "LlamaModel",
    "Qwen2ForCausalLM": "Qwen2Model",
    "Qwen3ForCausalLM": "Qwen3Model",
}


def get_model_class(hf_config: PretrainedConfig, model_dir: str | None = None) -> type[nn.Module]:
    """The class for `hf_config.architectures[0]`; ValueError naming it and the supported ones.
    A sentence-transformers checkpoint in `model_dir` (modules.json) gets the bare decoder's class."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(
            "the model config has no 'architectures' entry; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = architectures[0]
    if arch not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {arch!r}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if (
        model_dir is not None
        and arch in _BARE_FOR_EMBEDDING
        and (Path(model_dir) / "modules.json").is_file()
    ):
        return _MODELS[_BARE_FOR_EMBEDDING[arch]]
    return _MODELS[arch]

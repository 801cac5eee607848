"""Maps `config.architectures[0]` to the model class, so the runner never names a model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from kvserve.models.bart import BartForConditionalGeneration, MarianMTModel, MBartForConditionalGeneration
from kvserve.models.gpt2 import GPT2LMHeadModel
from kvserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvserve.models.mixtral import MixtralForCausalLM
from kvserve.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
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
    # mixture of experts (models/moe.py)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    # encoder-decoders (models/seq2seq.py): CPU, PyTorch attention, no tensor parallelism yet
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "MarianMTModel": MarianMTModel,
    "MBartForConditionalGeneration": MBartForConditionalGeneration,
    "T5ForConditionalGeneration": T5ForConditionalGeneration,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for `hf_config.architectures[0]`; ValueError naming it and the supported ones."""
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
    return _MODELS[arch]

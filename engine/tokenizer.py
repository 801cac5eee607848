"""Find and read a checkpoint's files: config, tokenizer, context length, EOS ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.engine.config import ModelConfig
from kvserve.engine.input_processor import load_tokenizer
from kvserve.models import ensure_default_model
from kvserve.models.hf_config import load_hf_config
from kvserve.models.timing import phase

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    model_path: str
    hf_config: (
        transformers.PretrainedConfig
    )  # or models.hf_config.CheckpointConfig (same attributes)
    tokenizer: transformers.PreTrainedTokenizerBase
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    decoder_start_token_id: int | None = None  # encoder-decoder models only


def load_model_files(config: ModelConfig) -> ModelFiles:
    # (the loader imports torch: here, so that importing the engine does not)
    from kvserve.models.loader import (
        get_decoder_start_token_id,
        get_eos_token_ids,
        get_max_model_len,
        resolve_model_path,
    )

    with phase("model files"):
        if config.model is None:
            model_path = ensure_default_model()
            logger.info("no model given: serving the embedded default model at %s", model_path)
        else:
            model_path = resolve_model_path(config.model)
    with phase("config"):
        hf_config = load_hf_config(model_path)
    with phase("tokenizer"):
        tokenizer = load_tokenizer(config.tokenizer or model_path)
    model_limit = get_max_model_len(hf_config)
    max_model_len = config.max_model_len or model_limit
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {model_limit}")
    eos = list(get_eos_token_ids(model_path, hf_config))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return ModelFiles(
        model_path=model_path,
        hf_config=hf_config,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        eos_token_ids=tuple(eos),
        decoder_start_token_id=get_decoder_start_token_id(model_path, hf_config),
    )

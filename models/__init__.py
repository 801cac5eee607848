"""Model definitions (HF parameter names), paged attention and the safetensors loader.

    from kvserve.models import get_model_class, load_model, SUPPORTED_ARCHITECTURES
    from kvserve.models.attention import AttentionMetadata, forward_context, Attention

Names are imported lazily, so that `models.default_model`'s lookups (which the server
process makes) do not import torch.
"""

import importlib

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "kvserve.models.registry",
    "get_model_class": "kvserve.models.registry",
    "get_decoder_start_token_id": "kvserve.models.loader",
    "get_eos_token_ids": "kvserve.models.loader",
    "get_max_model_len": "kvserve.models.loader",
    "load_model": "kvserve.models.loader",
    "resolve_model_path": "kvserve.models.loader",
    "built_default_model": "kvserve.models.default_model",
    "ensure_default_model": "kvserve.models.default_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvserve.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

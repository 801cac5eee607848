"""Model definitions (HF parameter names), paged attention and the safetensors loader.

    from models import get_model_class, load_model, SUPPORTED_ARCHITECTURES
    from models.attention import AttentionMetadata, forward_context, Attention
"""

from models.loader import get_eos_token_ids, get_max_model_len, load_model, resolve_model_path
from models.registry import SUPPORTED_ARCHITECTURES, get_model_class


def ensure_default_model(cache_dir: str | None = None) -> str:
    """The built-in default model's directory (built on first use); see `models.default_model`."""
    from models.default_model import ensure_default_model as ensure

    return ensure(cache_dir)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ensure_default_model",
    "get_eos_token_ids",
    "get_max_model_len",
    "get_model_class",
    "load_model",
    "resolve_model_path",
]

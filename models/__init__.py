"""Model definitions (HF parameter names), paged attention and the safetensors loader.

    from kvserve.models.loader import load_model
    from kvserve.models.registry import SUPPORTED_ARCHITECTURES, get_model_class
    from kvserve.models.attention import AttentionMetadata, forward_context, Attention

The package itself exports only the embedded default model's lookups, which the server's
process makes: they import no torch (the loader and the registry do).
"""

from kvserve.models.default_model import built_default_model, ensure_default_model

__all__ = ["built_default_model", "ensure_default_model"]

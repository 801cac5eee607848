"""Read a checkpoint's `config.json` without importing transformers, for the families we serve.

Importing transformers' config classes (5.x) pulls in torch.distributed, torch._dynamo and sympy:
over a second, most of a small model's start-up. For a plain config of a family in
`FAMILY_DEFAULTS` (rope: default, linear or llama3) the file is read here instead, with the
defaults and derived values transformers gives the attributes our models read
(tests/test_hf_config.py checks them against transformers for every family). Anything else (other
rope types, an unknown `model_type`, nested text configs) goes to `transformers.AutoConfig`, so no
config is read differently from the reference. The defaults and derived values follow transformers 5
(what the tests compare against); 4.x config objects carry rope as `rope_theta` + `rope_scaling`
instead of `rope_parameters`, and the models read either form.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_DECODER = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_key_value_heads=None,
    pad_token_id=None,
    rope_theta=10000.0,
)
_QWEN = dict(
    _DECODER,
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=32768,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    layer_types=None,
    bos_token_id=None,
    eos_token_id=None,
)

# transformers' defaults for the attributes kvserve reads, per `model_type`.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _DECODER,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        attention_bias=False,
        mlp_bias=False,
        head_dim=None,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "mistral": dict(
        _DECODER,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=None,
        max_position_embeddings=4096 * 32,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=128, attention_bias=False),
    "gpt2": dict(
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_inner=None,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        tie_word_embeddings=True,
        bos_token_id=50256,
        eos_token_id=50256,
        pad_token_id=None,
    ),
}

# GPT-2's HF names for the common attributes (transformers' `attribute_map`).
_ALIASES = {
    "gpt2": {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "max_position_embeddings": "n_positions",
    },
}


class CheckpointConfig:
    """A read-only view of a config: attribute access like `PretrainedConfig`, HF names."""

    def __init__(self, values: dict[str, Any], aliases: dict[str, str]) -> None:
        self.__dict__.update(values)
        self.__dict__["_aliases"] = aliases

    def __getattr__(self, name: str) -> Any:  # only called for names not set: the aliases
        aliases = self.__dict__.get("_aliases", {})
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(f"config has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the checkpoint config is read-only")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_aliases"}

    def __repr__(self) -> str:
        return f"CheckpointConfig({self.to_dict()!r})"


def load_hf_config(model_dir: str | Path) -> Any:
    """The checkpoint's config: a `CheckpointConfig` when `read_plain_config` can read it, else
    `transformers.AutoConfig`'s; a GGUF file's from its metadata, converted once
    (models/gguf_metadata.py)."""
    if str(model_dir).endswith(".gguf"):
        from kvserve.models.gguf_metadata import gguf_metadata_dir

        model_dir = gguf_metadata_dir(model_dir)
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = None  # let transformers say what is wrong with it
    config = read_plain_config(raw) if isinstance(raw, dict) else None
    if config is not None:
        return config
    import transformers

    return text_part(transformers.AutoConfig.from_pretrained(model_dir))


# Multimodal architectures served as their text decoder (models/registry.py): the config read is
# the nested `text_config`, which carries what the engine reads (vocab_size, max_position_embeddings).
TEXT_ONLY_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


def text_part(config: Any) -> Any:
    """`config`, or for a `TEXT_ONLY_ARCHITECTURES` model its `text_config` under the outer
    architecture name (so the registry still picks the class that maps the weights' names)."""
    architectures = getattr(config, "architectures", None) or []
    text_config = getattr(config, "text_config", None)
    if not architectures or architectures[0] not in TEXT_ONLY_ARCHITECTURES or text_config is None:
        return config
    text_config.architectures = list(architectures)
    for key in (
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
    ):  # the outer config's, when it has them
        if getattr(config, key, None) is not None:
            setattr(text_config, key, getattr(config, key))
    return text_config


def read_plain_config(raw: dict[str, Any]) -> CheckpointConfig | None:
    """`raw` (a parsed config.json) with transformers' defaults and derived values, or None when
    it is not a plain config of a family in `FAMILY_DEFAULTS`."""
    model_type = raw.get("model_type")
    defaults = FAMILY_DEFAULTS.get(model_type)
    if defaults is None or "text_config" in raw:
        return None
    values = {**defaults, **raw}
    if model_type != "gpt2":
        rope = _rope(raw)
        if rope is None:
            return None
        values.pop("rope_theta", None)
        values.pop("rope_scaling", None)
        values["rope_parameters"] = rope
        _derive_decoder_values(model_type, values)
    return CheckpointConfig(values, _ALIASES.get(model_type, {}))


_ROPE_TYPES = ("default", "linear", "llama3")  # what models.layers.rope_inv_freq computes


def _rope(raw: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5's `rope_parameters` for `raw`, or None for a rope set-up we leave to it."""
    params, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    if params is not None:  # written by transformers 5
        ok = (
            isinstance(params, dict)
            and scaling is None
            and params.get("rope_type", "default") in _ROPE_TYPES
        )
        return dict(params) if ok and "rope_theta" in params else None
    theta = raw.get("rope_theta", 10000.0)
    if scaling is None:
        return {"rope_theta": theta, "rope_type": "default"}
    rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    return (
        {**scaling, "rope_theta": theta, "rope_type": rope_type}
        if rope_type in _ROPE_TYPES
        else None
    )


def _derive_decoder_values(model_type: str, values: dict[str, Any]) -> None:
    """What transformers' config classes compute in `__post_init__`."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if "head_dim" in values and values["head_dim"] is None:  # Qwen2 has no head_dim attribute
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):
        if not values["use_sliding_window"]:
            values["sliding_window"] = None
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention"
                if values["sliding_window"] is not None and i >= values["max_window_layers"]
                else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]

"""Embeddings: what a request asks (`PoolingParams`), what the checkpoint says (`PoolerConfig`), and the
validation of an embedding prompt. Imports no torch.

An embedding request is a prefill that samples nothing: the runner pools the prompt's final hidden
states (after the final norm, before the LM head) when its last prompt token is computed, and the
request finishes in that step and frees its blocks. `last` takes the last token's state (the
decoder-embedding models' choice: Qwen3-Embedding, e5-mistral), `mean` averages every position.
Defaults follow the checkpoint: sentence-transformers' `1_Pooling/config.json` names the pooling mode;
without it, `last`. Vectors are L2-normalized unless `normalize=False` (vLLM's default for embed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TASKS = ("generate", "embed")
POOLING_TYPES = ("last", "mean")
# sentence-transformers' 1_Pooling/config.json flags -> ours
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(slots=True)
class PoolingParams:
    """An embedding request's settings (vLLM's name); None means the model's default."""

    pooling_type: str | None = None  # "last" | "mean"
    normalize: bool | None = None  # L2-normalize the vector
    dimensions: int | None = (
        None  # Matryoshka: keep the first N (only if the checkpoint declares it)
    )

    def validate(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """The model's embedding defaults and limits, read from its checkpoint once at load."""

    hidden_size: int
    pooling_type: str = "last"
    normalize: bool = True
    # Matryoshka models may be cut to fewer dimensions: any (is_matryoshka) or these (matryoshka_dimensions)
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """`params` with the defaults filled in; ValueError naming `dimensions` if the model cannot cut."""
        params.validate()
        dims = params.dimensions
        if dims is not None and dims != self.hidden_size:
            if not self.is_matryoshka and self.matryoshka_dimensions is None:
                raise ValueError(
                    f"dimensions: this model does not support Matryoshka embeddings; its vectors have "
                    f"{self.hidden_size} dimensions (got dimensions={dims})"
                )
            allowed = self.matryoshka_dimensions
            if (allowed is not None and dims not in allowed) or dims > self.hidden_size:
                raise ValueError(
                    f"dimensions must be one of {list(allowed or ())} or at most {self.hidden_size}, "
                    f"got {dims}"
                )
        return replace(
            params,
            pooling_type=params.pooling_type or self.pooling_type,
            normalize=self.normalize if params.normalize is None else params.normalize,
            dimensions=None if dims == self.hidden_size else dims,
        )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_embedding_checkpoint(model_path: str, hf_config: Any) -> bool:
    """A checkpoint made for embeddings, loaded without an LM head (models/registry.py): a bare decoder
    (`Qwen3Model`, `LlamaModel`), or sentence-transformers' layout (modules.json; Qwen3-Embedding
    names Qwen3ForCausalLM but ships no LM head)."""
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    is_bare = arch.endswith("Model") and not arch.endswith(("LMHeadModel", "MTModel"))
    return is_bare or (Path(model_path) / "modules.json").is_file()


def resolve_task(task: str | None, model_path: str, hf_config: Any) -> str:
    """The task to serve: as asked, else `embed` for an embedding checkpoint and `generate` otherwise."""
    if task is None:
        return "embed" if is_embedding_checkpoint(model_path, hf_config) else "generate"
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if task == "generate" and is_embedding_checkpoint(model_path, hf_config):
        raise ValueError(
            f"{model_path} is an embedding checkpoint ({hf_config.architectures[0]}, loaded without "
            "an LM head): it can only embed (task 'embed')"
        )
    return task


def read_pooler_config(model_path: str, hf_config: Any) -> PoolerConfig:
    """Pooling defaults from sentence-transformers' files when present; Matryoshka limits from config.json."""
    pooling_type = "last"
    modules = _read_json(Path(model_path) / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
                settings = (
                    _read_json(Path(model_path) / str(module.get("path", "")) / "config.json") or {}
                )
                modes = [ours for key, ours in _ST_POOLING_MODES.items() if settings.get(key)]
                if not modes and any(
                    v is True for k, v in settings.items() if k.startswith("pooling_mode")
                ):
                    raise ValueError(
                        f"{model_path}: unsupported sentence-transformers pooling {settings}; "
                        f"kvserve pools {POOLING_TYPES}"
                    )
                pooling_type = modes[0] if modes else pooling_type
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(
        hidden_size=hf_config.hidden_size,
        pooling_type=pooling_type,
        normalize=True,
        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
    )

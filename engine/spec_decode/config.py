"""Speculative decoding's configuration, as vLLM's users write it (`speculative_config`): a leaf
module, so that the engine's option declarations can name it without importing the proposer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# Speculation pays where a step is bound by reading the weights; with many sequences in the batch
# the extra rows cost compute. Above this many running sequences no drafts are proposed.
DEFAULT_MAX_BATCH = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    model: str | None = None  # draft_model: the draft checkpoint (the target's vocabulary)
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch_size: int = DEFAULT_MAX_BATCH  # speculate only while at most this many sequences run

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported (supported: "
                f"{', '.join(METHODS)})"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "max_batch_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config {name} must be a positive integer, got {value!r}"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config 'model' (the draft checkpoint) is required with method "
                "draft_model, and only there"
            )
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) is below "
                f"prompt_lookup_min ({self.prompt_lookup_min})"
            )

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (None or an empty value: no speculation);
        ValueError naming what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {sorted(unknown)} (known: "
                f"{', '.join(cls.__dataclass_fields__)})"
            )
        if "method" not in value:
            raise ValueError(
                f"speculative_config needs a 'method' (supported: {', '.join(METHODS)})"
            )
        return cls(**value)

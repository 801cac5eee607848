"""A checkpoint's generation_config.json, applied as transformers' `generate()` applies it.

    --generation-config auto    (the default) the model folder's generation_config.json
    --generation-config vllm    none of it: kvserve's own defaults and no extra processors
    --generation-config FOLDER  that folder's generation_config.json

Two parts come out of the file (vLLM's `--generation-config` does the first):
- request defaults: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
  `max_new_tokens` (as max_tokens) for a request that leaves them out, and `num_beams`,
  `length_penalty`, `early_stopping` for a beam search that does;
- `GenerationConstraints`: `no_repeat_ngram_size`, `bad_words_ids`, `min_length`,
  `min_new_tokens`, `forced_bos_token_id`, `forced_eos_token_id`, applied to every request's
  logits each step (engine/generation_logits.py) unless the request brings its own.

EOS ids and `decoder_start_token_id` are read from the checkpoint in every mode (models/loader.py).
Every value is checked when the engine starts: a bad one is a ValueError naming the file and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.engine.sampling_params import GenerationConstraints, SamplingParams

MODES = ("auto", "vllm")
# fields that become SamplingParams defaults (file name -> SamplingParams name), as vLLM reads them
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """What the engine applies from a generation config (plain data: it crosses to the server in
    `RuntimeInfo`). Empty in `vllm` mode or without a file."""

    source: str = "vllm"  # the file read, or "vllm" / "none"
    sampling_defaults: dict[str, float] = field(
        default_factory=dict
    )  # SamplingParams name -> value
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    constraints: GenerationConstraints | None = None

    def default_sampling_params(self) -> SamplingParams:
        """kvserve's defaults with the checkpoint's in place of them (vLLM's `get_default_sampling_params`)."""
        values = {
            k: int(v) if k in ("top_k", "max_tokens") else v
            for k, v in self.sampling_defaults.items()
        }
        return SamplingParams(**values)  # type: ignore[arg-type]  # names from _SAMPLING_FIELDS, numbers all

    def describe(self) -> str:
        """The defaults and processors applied, for the start-up log."""
        parts = [f"{k}={v!r}" for k, v in self.sampling_defaults.items()]
        parts += [
            f"{k}={getattr(self, k)!r}"
            for k in ("num_beams", "length_penalty", "early_stopping")
            if getattr(self, k) is not None
        ]
        if self.constraints is not None:
            parts += [
                f"{k}={v!r}"
                for k, v in zip(
                    self.constraints.__struct_fields__,
                    (getattr(self.constraints, k) for k in self.constraints.__struct_fields__),
                )
                if v not in (0, (), None)
            ]
        return ", ".join(parts)


def check_mode(value: Any) -> None:
    """`generation_config` is auto, vllm or a folder path (its file is read at load)."""
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder path, got {value!r}"
        )


def load_generation_config(
    mode: str, model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GenerationConfig:
    """The generation config `mode` names, for a model with `vocab_size` tokens."""
    check_mode(mode)
    if mode == "vllm":
        return GenerationConfig()
    folder = Path(model_path) if mode == "auto" else Path(mode).expanduser()
    if mode != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config {mode!r}: no generation_config.json in that folder")
    path = folder / "generation_config.json"
    if not path.is_file():  # (a GGUF file, a checkpoint without one)
        return GenerationConfig(source="none")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return parse_generation_config(raw, str(path), vocab_size, eos_token_ids)


def parse_generation_config(
    raw: dict[str, Any], source: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GenerationConfig:
    """Validate the fields kvserve applies (others are ignored, as transformers' unknown ones are)."""
    check = _Checker(raw, source, vocab_size)
    defaults: dict[str, float] = {}
    for name, target in _SAMPLING_FIELDS.items():
        value = check.number(name, int_only=name in ("top_k", "max_new_tokens"))
        if value is not None:
            defaults[target] = value
    if raw.get("do_sample") is False:  # generate() is greedy then, whatever the temperature says
        defaults = {k: v for k, v in defaults.items() if k in ("repetition_penalty", "max_tokens")}
        defaults["temperature"] = 0.0
    check.sampling(defaults)
    num_beams = check.integer("num_beams", lo=1)
    length_penalty = check.number("length_penalty")
    early_stopping = raw.get("early_stopping")
    if early_stopping not in (None, True, False, "never"):
        raise check.error("early_stopping", 'true, false or "never"')
    # transformers drops a bad word that is an EOS alone (NoBadWordsLogitsProcessor)
    bad_words = tuple(w for w in check.bad_words() if not (len(w) == 1 and w[0] in eos_token_ids))
    forced_eos = check.token_ids("forced_eos_token_id")
    constraints = GenerationConstraints(
        no_repeat_ngram_size=check.integer("no_repeat_ngram_size", lo=0) or 0,
        bad_words_ids=bad_words,
        min_length=check.integer("min_length", lo=0) or 0,
        min_new_tokens=check.integer("min_new_tokens", lo=0) or 0,
        forced_bos_token_id=check.token_id("forced_bos_token_id"),
        forced_eos_token_ids=forced_eos,
    )
    return GenerationConfig(
        source=source,
        sampling_defaults=defaults,
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        constraints=None if constraints.is_empty else constraints,
    )


class _Checker:
    """Field checks that raise ValueError naming the file, the field and the value."""

    def __init__(self, raw: dict[str, Any], source: str, vocab_size: int) -> None:
        self.raw, self.source, self.vocab_size = raw, source, vocab_size

    def error(self, name: str, expected: str) -> ValueError:
        return ValueError(f"{self.source}: {name} must be {expected}, got {self.raw.get(name)!r}")

    def number(
        self, name: str, int_only: bool = False, lo: float | None = None
    ) -> float | int | None:
        value = self.raw.get(name)
        if value is None:
            return None
        kinds = (int,) if int_only else (int, float)
        if (
            isinstance(value, bool)
            or not isinstance(value, kinds)
            or value != value
            or abs(value) == float("inf")
        ):
            raise self.error(name, "an integer" if int_only else "a finite number")
        if lo is not None and value < lo:
            raise self.error(name, f">= {lo}")
        return value

    def integer(self, name: str, lo: int | None = None) -> int | None:
        value = self.number(name, int_only=True, lo=lo)
        return None if value is None else int(value)

    def sampling(self, defaults: dict[str, float]) -> None:
        """The defaults as a request would give them: SamplingParams' own checks, named here."""
        try:
            GenerationConfig(sampling_defaults=defaults).default_sampling_params()
        except ValueError as e:
            name = next((n for n, t in _SAMPLING_FIELDS.items() if t in str(e)), "a sampling field")
            raise ValueError(f"{self.source}: {name}: {e}") from None

    def token_id(self, name: str) -> int | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 <= value < self.vocab_size
        ):
            raise self.error(name, f"a token id in [0, {self.vocab_size})")
        return value

    def token_ids(self, name: str) -> tuple[int, ...]:
        """An id or a list of ids (transformers takes both for forced_eos_token_id)."""
        value = self.raw.get(name)
        if value is None:
            return ()
        ids = value if isinstance(value, list) else [value]
        if not ids or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size
            for i in ids
        ):
            raise self.error(name, f"a token id in [0, {self.vocab_size}) or a list of them")
        return tuple(ids)

    def bad_words(self) -> tuple[tuple[int, ...], ...]:
        value = self.raw.get("bad_words_ids")
        if value is None:
            return ()
        ok = isinstance(value, list) and all(
            isinstance(w, list)
            and w
            and all(
                not isinstance(i, bool) and isinstance(i, int) and 0 <= i < self.vocab_size
                for i in w
            )
            for w in value
        )
        if not ok:
            raise self.error(
                "bad_words_ids", f"a list of non-empty lists of token ids in [0, {self.vocab_size})"
            )
        return tuple(tuple(w) for w in value)


def beam_step_constraints(
    constraints: GenerationConstraints | None, step: int, max_tokens: int
) -> GenerationConstraints:
    """The constraints of one beam search step's one-token requests (the step-th new token, from 0):
    the search's own max_tokens and output length, not the step request's."""
    if constraints is None:
        return GenerationConstraints()
    return GenerationConstraints(
        no_repeat_ngram_size=constraints.no_repeat_ngram_size,
        bad_words_ids=constraints.bad_words_ids,
        min_length=constraints.min_length,
        min_new_tokens=1 if step < constraints.min_new_tokens else 0,
        forced_bos_token_id=constraints.forced_bos_token_id,
        forced_eos_token_ids=constraints.forced_eos_token_ids if step == max_tokens - 1 else (),
    )

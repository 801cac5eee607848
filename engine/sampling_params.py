"""Per-request sampling parameters (vLLM-compatible surface), validated once.

`SamplingParams` is a plain (mutable) dataclass because vLLM users commonly
build one object and tweak fields (`params.max_tokens = 64`). Validation runs in
`__post_init__`; code that mutates fields afterwards should call `validate()`
again, or use `replace(**changes)` which returns a new, validated copy. The
engine calls `validate()` once more when a request is added, so a mutated,
invalid object is still rejected at the edge rather than deep in the sampler.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgspec

from kvserve.engine.structured_output.schema import walk_schema

# Temperatures below this are treated as greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
# Largest number of top logprobs a request may ask for (OpenAI's top_logprobs cap).
MAX_NUM_LOGPROBS = 20
# OpenAI's logit_bias range
MAX_ABS_LOGIT_BIAS = 100.0
# Bounds on stop conditions (docs/server.md, "Limits"): OpenAI allows 4 stop sequences, vLLM
# sets no bound. Matching costs O(new text) per stop string per step, the text held back
# while streaming is up to the longest stop - 1 characters, and each stop string costs its
# length in failure links: 16 strings of 4,096 characters in all cover real end markers.
MAX_NUM_STOP = 16
MAX_STOP_CHARS = 4096
MAX_NUM_STOP_TOKEN_IDS = 256
# The sampler runs in float32, where 1e-50 is 0 and 1e39 is inf: a top_p of 0 or a penalty of
# 0 or inf turns every logit into -inf or NaN and every token into the first (end of text).
# top_p below MIN_TOP_P is raised to it, which keeps its meaning: any top_p <= 1 / vocab_size
# keeps only the most likely token. repetition_penalty outside the range is refused.
MIN_TOP_P = 1e-8
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4


class GenerationConstraints(
    msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True
):
    """transformers' logits processors that a checkpoint's generation_config.json switches on, as
    one request applies them (engine/generation_config.py, docs/generation_config.md). Lengths
    count the sequence's tokens: the prompt and the output (an encoder-decoder's decoder tokens)."""

    no_repeat_ngram_size: int = 0  # no n-gram of this size occurs twice (0: off)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never generated
    min_length: int = 0  # EOS banned while the sequence is shorter
    min_new_tokens: int = 0  # EOS banned while the output is shorter
    forced_bos_token_id: int | None = (
        None  # the token after a one-token sequence (a decoder's start)
    )
    forced_eos_token_ids: tuple[int, ...] = ()  # forced as the request's last token (max_tokens)

    @property
    def is_empty(self) -> bool:
        return self == _NO_CONSTRAINTS


_NO_CONSTRAINTS = GenerationConstraints()

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What the output must match: exactly one of
    `json` (a JSON Schema, as a dict or a JSON string), `json_object=True` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (xgrammar's EBNF, GBNF-style).
    `any_whitespace=False` (the default) makes JSON compact (`{"a": 1, "b": [2, 3]}`), which
    keeps a model from padding the output with whitespace until max_tokens."""

    json: dict[str, Any] | str | bool | None = None  # (a JSON Schema may be true or false)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is taken too, and kept as a tuple
    grammar: str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [
            k
            for k in _KINDS
            if (getattr(self, k) is not None and k != "json_object")
            or (k == "json_object" and self.json_object is not False)
        ]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got "
                f"{given or 'none'}"
            )
        if not isinstance(self.any_whitespace, bool):
            raise ValueError(
                f"structured_outputs.any_whitespace must be a bool, got {self.any_whitespace!r}"
            )
        kind = given[0]
        if kind == "json":
            object.__setattr__(self, "json", _check_schema(self.json))
        elif kind == "json_object" and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be True, got {self.json_object!r}"
            )
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"structured_outputs.{kind} must be a non-empty str, got {value!r}"
                )
        elif kind == "choice":
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of str, got {choice!r}"
                )
            for c in choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(
                        f"structured_outputs.choice must hold non-empty strings, got {c!r}"
                    )
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """Canonical form: equal specs (dict key order aside) share one compiled grammar."""
        return json.dumps(
            [self.kind, getattr(self, self.kind), self.any_whitespace], sort_keys=True
        )

    def __hash__(self) -> int:
        return hash(self.key)


def _check_schema(schema: Any) -> dict[str, Any] | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"structured_outputs.json is not valid JSON ({e}): {schema[:200]!r}"
            ) from None
        except RecursionError:
            raise ValueError("structured_outputs.json is nested too deeply to parse") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(
            f"structured_outputs.json must be a JSON Schema object, got {str(schema)[:200]!r}"
        )
    walk_schema(schema)  # refuses keywords the grammar cannot enforce, at any depth (no recursion)
    return schema


@dataclass(slots=True)
class SamplingParams:
    """How to pick each generated token and when to stop.

    `temperature=0` means greedy; `top_k` 0 or -1 means no top-k; `max_tokens=None`
    means "up to the context limit" (the engine fills in the real number).
    `stop` may be given as a single string; it is stored as a list.
    `min_tokens` forbids EOS and `stop_token_ids` until that many tokens exist
    (stop *strings* are still honoured, as in vLLM).
    `structured_outputs` constrains the output to a JSON schema, regex, choice list or grammar
    (engine/structured_output/grammar.py; a dict is turned into `StructuredOutputs`); `logit_bias` maps
    token ids to a bias in [-100, 100] added to their logits (ids are checked against the
    vocabulary when the request is added). `generation_constraints` replaces the checkpoint's
    generation-config processors for this request (None: the checkpoint's, per `generation_config`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None
    speculative: bool = (
        True  # False: this request never speculates (engine/spec_decode/proposer.py)
    )
    generation_constraints: GenerationConstraints | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field, normalizing types in place; raise ValueError naming the field and value."""
        self.n = _int("n", self.n, lo=1)
        self.temperature = _float("temperature", self.temperature, lo=0.0)
        self.top_p = max(_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0), MIN_TOP_P)
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or >= 0, got {self.top_k}")
        self.min_p = _float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, lo=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self.stop = _stop_list(self.stop)
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_NUM_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids accepts at most {MAX_NUM_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.speculative = _bool("speculative", self.speculative)
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, lo=0, hi=MAX_NUM_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int(
                "prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_NUM_LOGPROBS
            )
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True
        )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be between {MIN_REPETITION_PENALTY} and "
                f"{MAX_REPETITION_PENALTY:g} (float32 sampling), got {self.repetition_penalty}"
            )
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        self.frequency_penalty = _float(
            "frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0
        )
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.generation_constraints is not None and not isinstance(
            self.generation_constraints, GenerationConstraints
        ):
            raise ValueError(
                f"generation_constraints must be a GenerationConstraints, got "
                f"{self.generation_constraints!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self) -> SamplingParams:
        """A deep copy (lists are not shared)."""
        return copy.deepcopy(self)

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (unknown field names raise TypeError)."""
        return dataclasses.replace(self.clone(), **changes)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return int(value)


def _float(
    name: str, value: object, lo: float, hi: float | None = None, lo_open: bool = False
) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (value <= lo) if lo_open else (value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _stop_list(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
    num_chars = sum(len(s) for s in stop)
    if len(stop) > MAX_NUM_STOP or num_chars > MAX_STOP_CHARS:
        raise ValueError(
            f"stop accepts at most {MAX_NUM_STOP} strings of {MAX_STOP_CHARS} characters "
            f"in all, got {len(stop)} strings of {num_chars} characters"
        )
    return list(stop)


def _token_id_list(name: str, ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of int, got {ids!r}")
    for i in ids:
        if not _is_int(i) or i < 0:
            raise ValueError(f"{name} must contain only non-negative ints, got {i!r}")
    return list(ids)


def _structured_outputs(value: object) -> StructuredOutputs | None:
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputs(**value)
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from None
    raise ValueError(f"structured_outputs must be a StructuredOutputs or a dict, got {value!r}")


def _logit_bias(bias: object) -> dict[int, float] | None:
    """Token id -> bias; JSON's string keys ("50256") are accepted and made ints."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    result = {}
    for key, value in bias.items():
        token_id = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        result[token_id] = _float(
            f"logit_bias[{key!r}]", value, lo=-MAX_ABS_LOGIT_BIAS, hi=MAX_ABS_LOGIT_BIAS
        )
    return result or None

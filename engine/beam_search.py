"""Beam search, with transformers' `generate(num_beams=...)` semantics and vLLM's offline API.

    LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32, length_penalty=1.0))

Each step asks the engine for the next-token log-probabilities of every live beam (a one-token
request per beam, `logprobs=2 * beam_width`: a request's global top candidates all lie in its
beams' own top 2 * beam_width). Beams of one prompt are requests that share a token prefix, so
the paged cache shares their full blocks through prefix caching (each block freed once, when
the last beam holding it lets go) and only a beam's last, partial block is recomputed.

The selection is transformers' (generation/utils.py, `_beam_search`), so that sequences and
scores equal `generate(num_beams=B, length_penalty=..., early_stopping=...)`:
- candidates: the top (1 + number of EOS ids) * B of running score + log p(token) over all beams;
- a candidate ending in EOS, or reaching max_tokens, is finished when it ranks among the first
  B candidates, scored sum_logprob / generated_len ** length_penalty (EOS counted); the best B
  finished hypotheses are kept;
- the next beams are the best B candidates that did not finish;
- it stops when B hypotheses are finished and `early_stopping=True`, or when the best running
  beam cannot beat the worst kept hypothesis (`False`: judged at the current length;
  `"never"`: at max_tokens when length_penalty > 0), or when every candidate finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvserve.engine.sampling_params import MAX_NUM_LOGPROBS

# |length_penalty| bound: length ** penalty stays a finite float for any context length
# (transformers' useful range is about 0.5-2).
MAX_LENGTH_PENALTY = 10.0

# (prompt index of each beam, each beam's token ids so far: prompt + generated, k) -> for each
# beam, {token id: logprob} of its next token, at least its top k (the caller's engine call).
NextTokenScorer = Callable[[list[int], list[list[int]], int], list[dict[int, float]]]


@dataclass(slots=True)
class BeamSearchParams:
    """`beam_width` beams of up to `max_tokens` new tokens each.

    `length_penalty` divides a finished hypothesis' summed log-probability by its generated
    length ** length_penalty (> 0 favours longer outputs, < 0 shorter); `early_stopping` is
    transformers': True, False (its heuristic) or "never". `ignore_eos` keeps beams going past
    EOS (every hypothesis then has max_tokens tokens)."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.beam_width, bool)
            or not isinstance(self.beam_width, int)
            or not (1 <= self.beam_width <= MAX_NUM_LOGPROBS // 2)
        ):
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_NUM_LOGPROBS // 2}], got {self.beam_width!r}"
            )
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.length_penalty, bool)
            or not isinstance(self.length_penalty, (int, float))
            or not (-MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY)
        ):
            raise ValueError(
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                f"got {self.length_penalty!r}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
            )


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished hypothesis: `tokens` are the prompt's then the generated ones (EOS included
    where it ended on one), `score` the length-normalized score it was ranked by
    (transformers' `sequences_scores`), `cum_logprob` the summed log-probability."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) | "length"
    text: str | None = None

    @property
    def generated_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass(slots=True)
class BeamSearchOutput:
    """The hypotheses of one prompt, best first (beam_width of them)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(slots=True)
class _Beam:
    generated: list[int]
    logprob: float  # summed


@dataclass(slots=True)
class _Search:
    """The state of one prompt's search."""

    prompt: list[int]
    running: list[_Beam]
    finished: list[tuple[float, _Beam, str]] = field(
        default_factory=list
    )  # (score, beam, reason), best first
    improvable: bool = True
    done: bool = False


class BeamSearch:
    """The search over several prompts, driven from outside one step at a time, so that the
    offline API and the server's async engine run the same code:

        search = BeamSearch(prompts, params, eos_token_ids)
        while beams := search.live_beams():
            search.advance(<next-token logprobs of each beam, top 2 * beam_width at least>)
        outputs = search.outputs()
    """

    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: Sequence[int]
    ):
        self.params = params
        self.eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * params.beam_width
        self.searches = [_Search(prompt=list(p), running=[_Beam([], 0.0)]) for p in prompts]
        self.step = 0
        self._beams: list[tuple[int, _Beam]] = []

    @property
    def num_logprobs(self) -> int:
        """How many top logprobs each beam's next token needs."""
        return 2 * self.params.beam_width

    def live_beams(self) -> list[tuple[int, list[int]]]:
        """(prompt index, token ids: prompt + generated) of every beam still searching; empty when done."""
        if self.step == self.params.max_tokens:
            return []
        self._beams = [(i, b) for i, s in enumerate(self.searches) if not s.done for b in s.running]
        return [(i, self.searches[i].prompt + b.generated) for i, b in self._beams]

    def advance(self, logprobs: Sequence[dict[int, float]]) -> None:
        """One step, given {token id: logprob} of the next token of each beam `live_beams` gave."""
        if len(logprobs) != len(self._beams):
            raise ValueError(f"got logprobs for {len(logprobs)} beams, {len(self._beams)} are live")
        by_search: dict[int, list[tuple[float, int, int, _Beam]]] = {i: [] for i, _ in self._beams}
        for rank, ((i, beam), entry) in enumerate(zip(self._beams, logprobs)):
            by_search[i] += [
                (beam.logprob + logprob, rank, token, beam) for token, logprob in entry.items()
            ]
        self.step += 1
        last = self.step == self.params.max_tokens
        for i, candidates in by_search.items():
            # (a token the generation config bans or forces away has -inf: never a candidate)
            candidates = sorted(
                (c for c in candidates if c[0] > float("-inf")), key=lambda c: (-c[0], c[1], c[2])
            )[: self.num_candidates]
            _advance(self.searches[i], candidates, self.step, last, self.eos, self.params)
        self._beams = []

    def outputs(self) -> list[BeamSearchOutput]:
        return [
            BeamSearchOutput(
                [_sequence(s.prompt, score, beam, reason) for score, beam, reason in s.finished]
            )
            for s in self.searches
        ]


def beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    next_token_logprobs: NextTokenScorer,
) -> list[BeamSearchOutput]:
    """Run the search for every prompt together: one `next_token_logprobs` call per step with
    the live beams of every unfinished prompt."""
    search = BeamSearch(prompts, params, eos_token_ids)
    while beams := search.live_beams():
        search.advance(
            next_token_logprobs(
                [i for i, _ in beams], [tokens for _, tokens in beams], search.num_logprobs
            )
        )
    return search.outputs()


def _advance(
    search: _Search,
    candidates: list[tuple[float, int, int, _Beam]],
    length: int,
    last: bool,
    eos: tuple[int, ...],
    params: BeamSearchParams,
) -> None:
    """One step of transformers' selection for one prompt; `length` is the new generated length."""
    width = params.beam_width
    ends = [last or token in eos for _, _, token, _ in candidates]
    full = len(search.finished) == width
    if search.improvable and not (full and params.early_stopping is True):
        for (logprob, _, token, beam), end in zip(candidates[:width], ends[:width]):
            if end:
                score = logprob / length**params.length_penalty
                reason = "stop" if token in eos else "length"
                search.finished.append((score, _Beam(beam.generated + [token], logprob), reason))
        search.finished.sort(key=lambda f: -f[0])
        del search.finished[width:]
    search.running = [
        _Beam(beam.generated + [token], logprob)
        for (logprob, _, token, beam), end in zip(candidates, ends)
        if not end
    ][:width]
    full = len(search.finished) == width
    if full and search.running:
        best_length = (
            params.max_tokens
            if params.early_stopping == "never" and params.length_penalty > 0
            else length
        )
        best_possible = search.running[0].logprob / best_length**params.length_penalty
        search.improvable = search.improvable and best_possible > search.finished[-1][0]
    stop_early = full and params.early_stopping is True
    search.done = last or not search.improvable or stop_early or all(ends)


def _sequence(prompt: list[int], score: float, beam: _Beam, reason: str) -> BeamSearchSequence:
    return BeamSearchSequence(
        tokens=prompt + beam.generated,
        num_prompt_tokens=len(prompt),
        cum_logprob=beam.logprob,
        score=score,
        finish_reason=reason,
    )

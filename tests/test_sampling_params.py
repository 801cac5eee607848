import pytest

from kvserve.engine.sampling_params import MAX_NUM_LOGPROBS, SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16,
        0,
        None,
        None,
        None,
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert not p.is_greedy and not p.has_penalties


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    p = SamplingParams(temperature=0)
    assert p.is_greedy and isinstance(p.temperature, float)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(seed=2**70).seed == 2**70
    assert SamplingParams(seed=-3).seed == -3
    assert SamplingParams(logprobs=0).logprobs == 0
    assert (
        SamplingParams(min_p=1.0, top_p=1.0, presence_penalty=-2, frequency_penalty=2).min_p == 1.0
    )
    assert SamplingParams(repetition_penalty=1.3).has_penalties


def test_replace_validates_and_copies():
    p = SamplingParams(stop=["x"], temperature=0.5)
    q = p.replace(max_tokens=3)
    assert q.max_tokens == 3 and q.temperature == 0.5 and p.max_tokens == 16
    q.stop.append("y")
    assert p.stop == ["x"]  # not shared
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=0.0)
    c = p.clone()
    assert c == p and c is not p


def test_mutation_then_validate():
    p = SamplingParams()
    p.temperature = -1.0  # mutable, as in vLLM
    with pytest.raises(ValueError, match=r"temperature must be >= 0.0, got -1.0"):
        p.validate()


BAD = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", "2"),
    ("n", True),
    ("temperature", -1.0),
    ("temperature", -0.01),
    ("temperature", "0.7"),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", "1"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "3"),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 17),  # default max_tokens is 16
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.01),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", 2.5),
    ("logprobs", -1),
    ("logprobs", MAX_NUM_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", MAX_NUM_LOGPROBS + 1),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_values_raise(field, value):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    msg = str(excinfo.value)
    assert field in msg
    bad = value[-1] if isinstance(value, list) else value
    assert str(bad) in msg or repr(bad) in msg, msg


def test_message_format():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0.0, got -1.0$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)

"""loadtest/ pure parts: schedules, statistics, datasets, SSE parsing, metrics parsing.

No sleeping, no sockets, no timing assertions: the arrival process is tested on
the schedule alone and the HTTP client against an in-process httpx transport.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from kvserve.loadtest.arrivals import (
    arrival_offsets,
    arrival_offsets_for_duration,
    inter_arrival_gaps,
)
from kvserve.loadtest.bench import plan_disconnects
from kvserve.loadtest.cli import build_parser
from kvserve.loadtest.client import (
    DISCONNECTED,
    FAILED,
    OK,
    RequestRecord,
    distribute_tokens,
    error_reason,
    send_request,
    spread_itl,
)
from kvserve.loadtest.datasets import (
    BenchRequest,
    prefix_repetition_requests,
    random_requests,
    sample_lengths,
    sharegpt_requests,
    translation_requests,
)
from kvserve.loadtest.metrics_scraper import MetricsSample, parse_metrics, summarize_samples
from kvserve.loadtest.report import (
    latency_stats,
    markdown_table,
    meets_slos,
    parse_goodput,
    peak_concurrency,
    summarize,
)
from kvserve.loadtest.token_source import FallbackTokenSource, TokenSource

# ---------------------------------------------------------------- arrivals


@pytest.mark.parametrize("rate", [0.5, 5.0, 200.0])
def test_poisson_mean_rate(rate):
    gaps = inter_arrival_gaps(20000, rate, burstiness=1.0, seed=1)
    # The sample mean of 20000 exponential gaps is within ~0.7% (1 sigma) of 1/rate.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0, 16.0])
def test_burstiness_sets_coefficient_of_variation(burstiness):
    gaps = inter_arrival_gaps(20000, 10.0, burstiness=burstiness, seed=2)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)  # burstiness never changes the rate
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(50, math.inf, burstiness=0.5, seed=3) == [0.0] * 50


def test_schedule_is_reproducible_and_ordered():
    a = arrival_offsets(1000, 4.0, 1.0, seed=7)
    assert a == arrival_offsets(1000, 4.0, 1.0, seed=7)
    assert a != arrival_offsets(1000, 4.0, 1.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert len(a) == 1000 and arrival_offsets(0, 4.0) == []


def test_duration_schedule_is_a_prefix_of_the_same_process():
    timed = arrival_offsets_for_duration(30.0, 4.0, 1.0, seed=5)
    assert all(t < 30.0 for t in timed)
    assert timed == arrival_offsets(len(timed) + 100, 4.0, 1.0, seed=5)[: len(timed)]
    assert len(timed) == pytest.approx(120, abs=45)  # Poisson(120): well within 4 sigma


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)])
def test_bad_schedule_arguments(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets(10, rate, burstiness)


def test_plan_disconnects_picks_exact_share():
    plan = plan_disconnects([10] * 40, 0.25, seed=0)
    picked = [p for p in plan if p is not None]
    assert len(picked) == 10 and all(0 <= p < 10 for p in picked)
    assert plan == plan_disconnects([10] * 40, 0.25, seed=0)
    assert plan_disconnects([10] * 5, 0.0, seed=0) == [None] * 5


# ---------------------------------------------------------------- summary math


def _record(i: int, ttft: float, e2e: float, tokens: int, status: str = OK, **kw) -> RequestRecord:
    itl = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if status == OK else []
    return RequestRecord(
        index=i,
        prompt_len=10,
        max_tokens=tokens,
        scheduled_s=i * 0.1,
        sent_s=i * 0.1,
        status=status,
        ttft_s=ttft,
        e2e_s=e2e,
        itl_s=itl,
        output_tokens=tokens,
        prompt_tokens=10,
        has_usage=True,
        **kw,
    )


def _synthetic_records() -> list[RequestRecord]:
    rng = np.random.default_rng(0)
    records = [
        _record(i, float(rng.uniform(0.01, 0.5)), float(rng.uniform(0.6, 3.0)), 11)
        for i in range(100)
    ]
    records.append(_record(100, None, 0.01, 0, status=FAILED, error="HTTP 400: too long"))
    records.append(_record(101, None, 0.02, 0, status=FAILED, error="HTTP 400: too long"))
    records.append(_record(102, 0.1, 0.3, 3, status=DISCONNECTED))
    return records


def test_summary_counts_throughput_and_ordering():
    records = _synthetic_records()
    s = summarize(records, duration_s=10.0, slos={})
    assert (s["num_sent"], s["completed"], s["failed"], s["disconnected"]) == (103, 100, 2, 1)
    assert s["failure_reasons"] == {"HTTP 400: too long": 2}
    assert s["total_output_tokens"] == 1100 and s["output_throughput"] == pytest.approx(110.0)
    assert s["request_throughput"] == pytest.approx(10.0)
    assert s["total_token_throughput"] == pytest.approx((1000 + 1100) / 10.0)
    for key in ("ttft", "tpot", "itl", "e2el"):
        stats = s[key]
        assert stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"]
    ok = [r for r in records if r.status == OK]
    assert s["ttft"]["mean_ms"] == pytest.approx(1000 * np.mean([r.ttft_s for r in ok]))
    assert s["tpot"]["p50_ms"] == pytest.approx(
        1000 * np.median([(r.e2e_s - r.ttft_s) / 10 for r in ok])
    )
    assert s["goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    records = _synthetic_records()
    slos = parse_goodput(["ttft:250", "e2el:2000"])
    assert slos == {"ttft": 250.0, "e2el": 2000.0}
    s = summarize(records, duration_s=10.0, slos=slos)
    expected = sum(r.status == OK and r.ttft_s <= 0.25 and r.e2e_s <= 2.0 for r in records)
    assert 0 < s["good_requests"] == expected < 100
    assert s["goodput"] == pytest.approx(expected / 10.0)
    assert not meets_slos(records[-1], slos)  # disconnected requests never count


@pytest.mark.parametrize("spec", [["ttft"], ["bogus:5"], ["tpot:0"], ["e2el:-1"]])
def test_bad_goodput_specs(spec):
    with pytest.raises(ValueError):
        parse_goodput(spec)


def test_latency_stats_empty_and_tpot_definition():
    assert latency_stats([]) == {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}
    r = _record(0, ttft=0.1, e2e=1.1, tokens=11)
    assert r.tpot_s == pytest.approx(0.1)
    assert _record(0, 0.1, 0.1, 1, status=FAILED).tpot_s is None


def test_peak_concurrency_and_markdown_table():
    records = [_record(i, 0.1, 1.0, 5) for i in range(3)]  # sent at 0, .1, .2; each lasts 1 s
    records.append(_record(30, 0.1, 0.5, 5))  # sent at 3.0, alone
    assert peak_concurrency(records) == 3
    s = summarize(records, 3.5, {})
    server = {"peak_kv_cache_usage": 0.5, "prefix_cache_hit_rate": 0.25}
    table = markdown_table([{"label": "rate-inf", "summary": s, "server": server}])
    assert (
        table.count("\n") == 2
        and "| rate-inf | 4 / 0 / 0 |" in table
        and "| 50.0 | 25.0 |" in table
    )
    assert len({line.count("|") for line in table.splitlines()}) == 1  # header, rule, rows align


# ---------------------------------------------------------------- client helpers


def test_spread_itl_and_distribute_tokens():
    assert spread_itl([1.0, 1.2, 1.8], [2, 1, 3]) == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert distribute_tokens(13, [1, 1, 8]) == [2, 2, 9]  # 1 each + 10 in proportion to text
    assert distribute_tokens(10, [1, 1, 8]) == [2, 2, 6]  # largest remainders round up
    assert sum(distribute_tokens(7, [5, 0, 3])) == 7
    assert distribute_tokens(2, [4, 4, 4]) == [1, 1, 1]  # never below one per chunk


def test_error_reason_formats():
    assert (
        error_reason(400, b'{"error": {"message": "prompt too long"}}')
        == "HTTP 400: prompt too long"
    )
    assert error_reason(422, b'{"detail": "bad"}') == "HTTP 422: bad"
    assert error_reason(503, b"overloaded") == "HTTP 503: overloaded"


def _sse(chunks: list[dict], done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _completion_stream(texts: list[str], usage: int | None) -> bytes:
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    if usage is not None:
        chunks.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": usage}})
    return _sse(chunks)


def _run_client(
    body: bytes, status: int = 200, endpoint: str = "completions", **record_kw
) -> RequestRecord:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    record = RequestRecord(index=0, prompt_len=4, max_tokens=6, scheduled_s=0.0, **record_kw)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(
                client, "http://test/v1/completions", {}, record, endpoint, 0.0
            )

    return asyncio.run(go())


def test_client_uses_usage_and_spreads_merged_chunks():
    r = _run_client(_completion_stream(["a", "bb", "c"], usage=6))
    assert r.status == OK and r.error is None and r.has_usage
    assert r.output_tokens == 6 and r.prompt_tokens == 4 and r.num_chunks == 3
    # 6 tokens over texts of 1, 2, 1 chars -> [2, 2, 2]; the first chunk's 2 get no ITL
    assert len(r.itl_s) == 4
    assert 0 <= r.ttft_s <= r.e2e_s


def test_client_counts_chunks_without_usage():
    r = _run_client(_completion_stream(["a", "b", "c", "d"], usage=None))
    assert r.status == OK and not r.has_usage and r.output_tokens == 4 and len(r.itl_s) == 3


def test_client_chat_ignores_role_only_chunk():
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}},
    ]
    r = _run_client(_sse(chunks), endpoint="chat")
    assert r.status == OK and r.num_chunks == 1 and r.output_tokens == 1 and r.tpot_s is None


def test_client_failures_and_disconnects():
    r = _run_client(b'{"error": {"message": "max_tokens too large"}}', status=400)
    assert r.status == FAILED and r.error == "HTTP 400: max_tokens too large"
    r = _run_client(_sse([{"error": {"message": "engine died"}}]))
    assert r.status == FAILED and r.error == "stream error: engine died"
    r = _run_client(_completion_stream(["a"], usage=1)[:20])  # cut mid-stream, no [DONE]
    assert r.status == FAILED and r.error
    r = _run_client(_completion_stream(["a", "b", "c"], usage=3), disconnect_after_chunks=2)
    assert r.status == DISCONNECTED and r.num_chunks == 2 and r.output_tokens == 2
    r = _run_client(_completion_stream(["a"], usage=1), disconnect_after_chunks=0)
    assert r.status == DISCONNECTED and r.num_chunks == 0 and r.ttft_s is None


# ---------------------------------------------------------------- datasets


class CharTokens(TokenSource):
    """An exact toy tokenizer: one token per character (ids are code points)."""

    name = "chars"

    def __init__(self) -> None:
        self.pool_ids = list(range(ord("a"), ord("z") + 1))

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))


def test_sample_lengths_bounds():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 100, 0.5, 5000)
    assert min(lens) >= 50 and max(lens) <= 150 and min(lens) < 60 and max(lens) > 140
    assert sample_lengths(rng, 7, 0.0, 10) == [7] * 10
    with pytest.raises(ValueError):
        sample_lengths(rng, 7, 1.0, 10)


@pytest.mark.parametrize("as_text", [False, True])
def test_random_requests_exact_lengths(as_text):
    reqs = random_requests(
        CharTokens(), 50, input_len=40, output_len=8, range_ratio=0.25, seed=1, as_text=as_text
    )
    assert len(reqs) == 50
    for r in reqs:
        assert isinstance(r.prompt, str if as_text else list)
        assert 30 <= r.prompt_len <= 50 and 6 <= r.output_len <= 10
        assert len(r.prompt) == r.prompt_len  # one token per char / per id
    assert len({tuple(r.prompt) for r in reqs}) == 50
    assert reqs == random_requests(CharTokens(), 50, 40, 8, 0.25, seed=1, as_text=as_text)


def test_random_requests_with_shared_prefix():
    reqs = random_requests(CharTokens(), 10, input_len=20, output_len=4, prefix_len=16, seed=0)
    assert all(r.prompt[:16] == reqs[0].prompt[:16] and r.prompt_len == 36 for r in reqs)


def test_prefix_repetition_groups_share_prefixes():
    reqs = prefix_repetition_requests(
        CharTokens(), 40, prefix_len=32, suffix_len=8, output_len=4, num_groups=4, seed=3
    )
    groups: dict[int, list[BenchRequest]] = {}
    for r in reqs:
        groups.setdefault(r.prefix_group, []).append(r)
        assert r.prompt_len == 40 and len(r.prompt) == 40
    assert sorted(groups) == [0, 1, 2, 3] and all(len(g) == 10 for g in groups.values())
    prefixes = {g: {tuple(r.prompt[:32]) for r in rs} for g, rs in groups.items()}
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group
    assert len(set().union(*prefixes.values())) == 4  # and the groups differ
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 40  # suffixes are unique
    assert [r.prefix_group for r in reqs[:8]] != sorted(
        r.prefix_group for r in reqs[:8]
    )  # interleaved


def test_prefix_repetition_text_mode_shares_prefix_text():
    reqs = prefix_repetition_requests(CharTokens(), 8, 24, 8, 4, num_groups=2, seed=0, as_text=True)
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.prefix_group, set()).add(r.prompt[:24])
    assert all(len(v) == 1 for v in by_group.values())


def test_sharegpt_parsing(tmp_path):
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "What is a paged KV cache?"},
                {"from": "gpt", "value": "Blocks of keys and values."},
            ],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},  # no reply
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "Say hi please"},
                {"from": "gpt", "value": "Hi there!"},
            ],
        },
        {
            "id": "d",
            "conversations": [
                {"from": "human", "value": "Hey"},  # prompt too short
                {"from": "gpt", "value": "Hello, how can I help?"},
            ],
        },
        {
            "id": "e",
            "messages": [
                {"role": "user", "content": "Role/content format works?"},
                {"role": "assistant", "content": "Yes it does."},
            ],
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, CharTokens(), num_requests=3, seed=0)
    got = {r.prompt: r.output_len for r in reqs}
    assert got == {
        "What is a paged KV cache?": 26,
        "Say hi please": 9,
        "Role/content format works?": 12,
    }
    assert all(r.prompt_len == len(r.prompt) for r in reqs)
    more = sharegpt_requests(path, CharTokens(), num_requests=7, seed=0, output_len=5)
    assert len(more) == 7 and {r.output_len for r in more} == {5}  # repeats, override applied
    path.write_text("[]")
    with pytest.raises(ValueError):
        sharegpt_requests(path, CharTokens(), 3)


def test_fallback_token_source_keeps_token_prompts_exact():
    reqs = random_requests(FallbackTokenSource(), 5, input_len=12, output_len=3, seed=0)
    assert all(len(r.prompt) == 12 and all(1 <= t < 256 for t in r.prompt) for r in reqs)


def test_local_tokenizer_text_prompts_are_close(tmp_path):
    from checkpoints import save_tokenizer
    from kvserve.loadtest.token_source import LocalTokenSource

    save_tokenizer(tmp_path)
    source = LocalTokenSource(str(tmp_path))
    assert source.pool_ids and not set(source.pool_ids) & set(source.tokenizer.all_special_ids)
    for r in random_requests(source, 10, input_len=30, output_len=4, seed=0, as_text=True):
        assert abs(len(source.encode(r.prompt)) - 30) <= 2


# ---------------------------------------------------------------- server metrics

CANNED_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 123.0
# HELP kvserve:num_requests_running Requests in the running batch.
# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{model_name="m"} 3.0
# HELP kvserve:num_requests_waiting Requests waiting to be scheduled.
# TYPE kvserve:num_requests_waiting gauge
kvserve:num_requests_waiting{model_name="m"} 1.0
# HELP kvserve:kv_cache_usage_perc Fraction of KV-cache blocks in use (0-1).
# TYPE kvserve:kv_cache_usage_perc gauge
kvserve:kv_cache_usage_perc{model_name="m"} 0.25
# HELP kvserve:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE kvserve:prefix_cache_queries_total counter
kvserve:prefix_cache_queries_total{model_name="m"} 1000.0
kvserve:prefix_cache_queries_created{model_name="m"} 1.7e+09
# HELP kvserve:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE kvserve:prefix_cache_hits_total counter
kvserve:prefix_cache_hits_total{model_name="m"} 250.0
# HELP kvserve:num_preemptions_total Preemptions.
# TYPE kvserve:num_preemptions_total counter
kvserve:num_preemptions_total{model_name="m"} 2.0
# HELP kvserve:generation_tokens_total Tokens generated.
# TYPE kvserve:generation_tokens_total counter
kvserve:generation_tokens_total{model_name="m"} 5000.0
# HELP kvserve:time_to_first_token_seconds TTFT.
# TYPE kvserve:time_to_first_token_seconds histogram
kvserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
kvserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 5.0
kvserve:time_to_first_token_seconds_count{model_name="m"} 5.0
kvserve:time_to_first_token_seconds_sum{model_name="m"} 0.7
"""


def test_parse_metrics_canned_text():
    assert parse_metrics(CANNED_METRICS) == {
        "num_running": 3.0,
        "num_waiting": 1.0,
        "kv_cache_usage": 0.25,
        "prefix_cache_queries": 1000.0,
        "prefix_cache_hits": 250.0,
        "num_preemptions": 2.0,
        "generation_tokens": 5000.0,
    }
    assert parse_metrics("# no kvserve here\nup 1\n") == {}


def test_parse_metrics_aggregates_over_models():
    two = CANNED_METRICS + CANNED_METRICS.replace('model_name="m"', 'model_name="n"').replace(
        "0.25", "0.5"
    )
    parsed = parse_metrics("\n".join(line for line in two.splitlines() if not line.startswith("#")))
    assert parsed["kv_cache_usage"] == 0.5 and parsed["num_running"] == 6.0


def test_summarize_samples_uses_deltas_over_the_run():
    before = parse_metrics(CANNED_METRICS)
    during = {**before, "kv_cache_usage": 0.75, "num_running": 8.0, "num_waiting": 5.0}
    after = {
        **before,
        "kv_cache_usage": 0.0,
        "num_running": 0.0,
        "num_waiting": 0.0,
        "prefix_cache_queries": 1400.0,
        "prefix_cache_hits": 550.0,
        "num_preemptions": 5.0,
        "generation_tokens": 6000.0,
    }
    samples = [MetricsSample(0.0, before), MetricsSample(1.0, during), MetricsSample(2.0, after)]
    s = summarize_samples(samples, kv_back_to_zero=True, drain_s=0.1)
    assert (
        s["peak_kv_cache_usage"] == 0.75
        and s["peak_num_running"] == 8.0
        and s["peak_num_waiting"] == 5.0
    )
    assert s["prefix_cache_hit_rate"] == pytest.approx(300 / 400)
    assert s["num_preemptions"] == 3.0 and s["generation_tokens"] == 1000.0
    assert s["kv_cache_back_to_zero"] is True
    assert summarize_samples([], None, None) == {"available": False}


# ---------------------------------------------------------------- CLI, plots, checkpoint


def test_cli_parses_sweeps_and_inf():
    args = build_parser().parse_args(
        [
            "serve",
            "--base-url",
            "http://x",
            "--request-rate",
            "1",
            "inf",
            "--max-concurrency",
            "1",
            "4",
            "--goodput",
            "ttft:500",
            "tpot:50",
        ]
    )
    assert args.request_rate == [1.0, math.inf] and args.max_concurrency == [1, 4]
    assert args.goodput == ["ttft:500", "tpot:50"] and args.dataset == "random"
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["serve", "--base-url", "u", "--num-prompts", "3", "--duration", "5"]
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--base-url", "u", "--request-rate", "0"])


def test_plots_from_a_result_document(tmp_path):
    from kvserve.loadtest.plots import plot_run, plot_sweep

    records = _synthetic_records()
    summary = summarize(records, 10.0, {})
    series = [
        {
            "t_s": t,
            "kv_cache_usage": u,
            "num_running": 2.0,
            "num_waiting": 0.0,
            "generation_tokens": g,
        }
        for t, u, g in ((0.0, 0.0, 0.0), (0.5, 0.4, 80.0), (1.0, 0.0, 160.0))
    ]
    doc = {"summary": summary, "metrics_series": series, "requests": [r.to_dict() for r in records]}
    paths = plot_run(json.loads(json.dumps(doc)), tmp_path)
    assert sorted(p.name for p in paths) == ["kv_cache.png", "latency_cdf.png", "timeline.png"]
    sweep = plot_sweep(
        [{"label": "a", "summary": summary}, {"label": "b", "summary": summary}],
        tmp_path / "sweep.png",
    )
    for p in [*paths, sweep]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smollm_tokenizer_every_id_decodes_to_ascii(tmp_path):
    from benchmarks.smollm_checkpoint import ascii_bpe_vocab, save_tokenizer

    vocab, merges = ascii_bpe_vocab(49152)
    assert len(vocab) == 49152 and sorted(vocab.values()) == list(range(49152))
    assert all(left in vocab and right in vocab for left, right in merges)
    tok = save_tokenizer(tmp_path, vocab_size=1200)
    assert len(tok) == 1200 and tok.eos_token_id == 0
    texts = [tok.decode([token_id]) for token_id in range(3, 1200)]
    # Only the 128 lone bytes >= 0x80 (kept so any text encodes) are not ASCII.
    assert sum("\ufffd" in t for t in texts) == 128
    assert all(t and t.isascii() for t in texts if "\ufffd" not in t)
    assert tok.decode(tok.encode("Hello world, 42!")) == "Hello world, 42!"


def test_result_files_are_strict_json(tmp_path):
    from kvserve.loadtest.report import dump_json

    dump_json(tmp_path / "x.json", {"rate": math.inf, "points": [{"nan": math.nan, "ok": 1.5}]})
    expected = {"rate": "inf", "points": [{"nan": "nan", "ok": 1.5}]}
    assert json.loads((tmp_path / "x.json").read_text()) == expected


def test_cli_reports_an_unreachable_server():
    from benchmarks.procs import free_port
    from kvserve.loadtest.cli import main

    assert main(["serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress"]) == 2


def test_translation_targets_follow_their_sources():
    reqs = translation_requests(
        CharTokens(), 50, source_len=40, target_ratio=1.2, range_ratio=0.5, seed=3
    )
    assert len({r.prompt_len for r in reqs}) > 10  # lengths vary (uniform in 20..60)
    for r in reqs:
        assert 20 <= r.prompt_len <= 60 and r.output_len == max(1, round(1.2 * r.prompt_len))
    assert translation_requests(CharTokens(), 50, 40, 1.2, 0.5, seed=3) == reqs  # seeded
    with pytest.raises(ValueError, match="target ratio"):
        translation_requests(CharTokens(), 1, 40, 0.0)


def test_translation_dataset_refuses_an_output_len():
    from kvserve.loadtest.cli import build_parser, build_requests

    args = build_parser().parse_args(
        [
            "serve",
            "--base-url",
            "http://x",
            "--dataset",
            "translation",
            "--output-len",
            "8",
            "--num-prompts",
            "2",
        ]
    )
    with pytest.raises(ValueError, match="target-ratio"):
        build_requests(args, CharTokens(), 0)
    args = build_parser().parse_args(
        [
            "serve",
            "--base-url",
            "http://x",
            "--dataset",
            "translation",
            "--input-len",
            "10",
            "--target-ratio",
            "2",
            "--num-prompts",
            "3",
        ]
    )
    assert [r.output_len for r in build_requests(args, CharTokens(), 0)] == [20, 20, 20]

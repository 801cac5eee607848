"""kvserve on Ray Serve: the routing policy (plain Python) and 2 replicas on a local Ray cluster.

The cluster tests share one module-scoped cluster and application (about 25 s to start on
2 cores); the replica-kill test runs last because it changes the replica set.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvserve.server.ray_options import RayServeOptions
from kvserve.server.ray_router import PrefixAffinity, prefix_hashes, routing_text

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

# --- the routing policy, no cluster ---------------------------------------------------------


def test_routing_text_of_each_request_shape() -> None:
    assert routing_text({"prompt": "hello"}) == "hello"
    assert routing_text({"prompt": ["first", "second"]}) == "first"
    assert routing_text({"prompt": [1, 22, 333]}) == "1,22,333"
    assert routing_text({"prompt": [[5, 6], [7]]}) == "5,6"
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        ]
    }
    assert routing_text(chat) == "system\nbe brief\nuser\nhi\n"
    for malformed in (None, [], "text", {"prompt": 3}, {"messages": "x"}, {"prompt": [1, "a"]}):
        assert routing_text(malformed) == ""


def test_prefix_hashes_chain_over_full_chunks() -> None:
    a = prefix_hashes("x" * 64 + "y" * 64 + "z" * 10)
    b = prefix_hashes("x" * 64 + "w" * 64)
    assert len(a) == 2 and len(b) == 2  # a partial last chunk is not hashed
    assert a[0] == b[0] and a[1] != b[1]  # equal first chunk, different second
    assert prefix_hashes("y" * 64 + "x" * 64)[1] != a[1]  # chained: the parent matters
    assert prefix_hashes("short") == []
    assert len(prefix_hashes("a" * 10_000, max_chunks=5)) == 5
    with pytest.raises(ValueError, match="chunk_chars"):
        prefix_hashes("abc", chunk_chars=0)


def test_affinity_prefers_the_holder_of_the_longest_prefix() -> None:
    policy = PrefixAffinity(max_imbalance=4)
    shared = prefix_hashes("s" * 256)
    policy.record(shared[:2], "a")
    policy.record(shared, "b")  # b holds the longer prefix
    assert policy.rank(["a", "b", "c"], {}, shared)[0] == ["b"]
    assert policy.match(shared[:2], {"a": 0, "b": 0, "c": 0}) == (
        "b",
        2,
    )  # both hold it: most recent
    assert policy.match(shared[:2], {"a": 0, "b": 1, "c": 0}) == ("a", 2)  # ... unless more loaded
    assert policy.match(shared, {"a": 0, "c": 0}) == ("a", 2)  # b is gone: a's shorter match


def test_affinity_falls_back_to_the_least_loaded_when_busy() -> None:
    policy = PrefixAffinity(max_imbalance=4)
    hashes = prefix_hashes("p" * 128)
    policy.record(hashes, "a")
    assert policy.rank(["a", "b"], {"a": 5, "b": 1}, hashes) == [["a"], ["b"]]  # 4 more: still a
    assert policy.rank(["a", "b"], {"a": 6, "b": 1}, hashes) == [["b"], ["a"]]  # 5 more: busy
    assert policy.rank(["a", "b"], {"a": None, "b": None}, hashes)[0] == [
        "a"
    ]  # unknown counts as 0


def test_unrelated_requests_take_equally_loaded_replicas_in_turn() -> None:
    policy = PrefixAffinity(max_imbalance=RayServeOptions().max_imbalance)
    firsts = [policy.rank(["a", "b", "c"], {}, prefix_hashes(f"{i}" * 64))[0][0] for i in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert policy.rank(["a", "b", "c"], {"a": 2, "b": 0, "c": 1}, []) == [["b"], ["c", "a"]]
    assert policy.rank([], {}, []) == []


def test_affinity_memory_is_bounded_and_forgets_dead_replicas() -> None:
    policy = PrefixAffinity(
        max_imbalance=RayServeOptions().max_imbalance, max_entries=3, max_holders=2
    )
    hashes = prefix_hashes("q" * 64 * 5)
    policy.record(hashes, "a")
    assert len(policy) == 3  # the oldest (shortest) prefixes were evicted
    assert policy.match(hashes, {"a": 0}) == ("a", 5)
    assert policy.match(hashes[:2], {"a": 0}) == (None, 0)
    for replica in ("a", "b", "c"):
        policy.record(hashes[-1:], replica)
    assert policy.match(hashes, {"a": 0, "b": 1, "c": 0}) == ("c", 5)  # at most 2 holders: c, b
    assert policy.match(hashes, {"a": 0}) == ("a", 4)
    policy.forget("a")
    assert policy.match(hashes, {"a": 0}) == (None, 0)
    with pytest.raises(ValueError, match="max_imbalance"):
        PrefixAffinity(max_imbalance=-1)


def test_merged_metrics_carry_a_replica_label() -> None:
    from kvserve.server.ray_serve import RayServeOptions, merge_replica_metrics

    text = (
        "# HELP kvserve:prefix_cache_hits_total Hits.\n# TYPE kvserve:prefix_cache_hits_total counter\n"
        'kvserve:prefix_cache_hits_total{model_name="m"} %d\n'
    )
    merged = merge_replica_metrics({"r1": text % 3, "r2": text % 5}).decode()
    assert merged.count("# TYPE kvserve:prefix_cache_hits_total counter") == 1
    assert 'kvserve:prefix_cache_hits_total{model_name="m",replica="r1"} 3.0' in merged
    assert 'kvserve:prefix_cache_hits_total{model_name="m",replica="r2"} 5.0' in merged
    for bad in (dict(num_replicas=0), dict(min_replicas=3, max_replicas=2), dict(routing="random")):
        with pytest.raises(ValueError, match=str(next(iter(bad.values())))):
            RayServeOptions(**bad)
    assert RayServeOptions(max_replicas=4).is_autoscaling


def test_cli_and_builder_check_their_options(capsys: pytest.CaptureFixture[str]) -> None:
    from ray.serve import Application

    from kvserve.server.cli import main
    from kvserve.server.ray_serve import app_builder

    assert main(["ray", "--replicas", "0"]) == 2
    assert main(["ray", "--min-replicas", "3", "--max-replicas", "2"]) == 2
    assert "min_replicas=3, max_replicas=2" in capsys.readouterr().err
    assert isinstance(
        app_builder({"model": "m", "num_replicas": "3", "routing": "pow2", "max_num_seqs": "8"}),
        Application,
    )
    assert isinstance(
        app_builder({"model": "m", "min_replicas": "1", "max_replicas": "3"}), Application
    )
    with pytest.raises(ValueError, match="max_num_seqs"):
        app_builder({"max_num_seqs": "0"})


# --- 2 replicas on a local Ray cluster ------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory):
    from ray import serve

    from kvserve.server.config import ServerConfig
    from kvserve.server.ray_serve import RayServeOptions, build_app
    from server_fixtures import cached_checkpoint, free_port

    model = cached_checkpoint(tmp_path_factory)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServerConfig(model=model, num_kv_blocks=128, max_num_seqs=16)
        serve.run(
            build_app(config, RayServeOptions(num_replicas=2)), name="kvserve", route_prefix="/"
        )
        yield f"http://127.0.0.1:{port}", model
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url: str, model: str, prompt: str, **extra) -> httpx.Response:
    response = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": model, "prompt": prompt, "max_tokens": 2, **extra},
    )
    assert response.status_code == 200, response.text
    return response


def test_openai_client_through_the_serve_endpoint(endpoint) -> None:
    import openai

    url, model = endpoint
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=4)
    assert completion.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    bad = httpx.post(
        url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def _hits_by_replica(url: str) -> dict[str, float]:
    from server_fixtures import scrape

    hits: dict[str, float] = {}
    for (name, labels), value in scrape(url).items():
        if name == "kvserve:prefix_cache_hits_total":
            replica = dict(labels)["replica"]
            hits[replica] = hits.get(replica, 0.0) + value
    return hits


def _wait_for_metrics(url: str, replicas: set[str], timeout_s: float = 20.0) -> dict[str, float]:
    """The merged /metrics once it has every replica (they push every second)."""
    deadline = time.monotonic() + timeout_s
    while not replicas <= set(hits := _hits_by_replica(url)):
        assert time.monotonic() < deadline, f"replicas {replicas} not all in /metrics: {hits}"
        time.sleep(0.2)
    return hits


def test_shared_prefix_lands_on_one_replica_and_unrelated_ones_spread(endpoint) -> None:
    url, model = endpoint
    unrelated = {
        _complete(url, model, f"request {i} " * 30).headers["x-kvserve-replica"] for i in range(4)
    }
    assert len(unrelated) == 2
    _wait_for_metrics(url, unrelated)
    time.sleep(1.5)  # a push of its own after the last request
    before = _hits_by_replica(url)
    shared = "Paged attention stores keys and values in fixed-size blocks of tokens. " * 8
    answered = {
        _complete(url, model, shared + f"question {i}?").headers["x-kvserve-replica"]
        for i in range(5)
    }
    assert len(answered) == 1
    (chosen,) = answered
    (other,) = unrelated - answered
    deadline = time.monotonic() + 20
    while (after := _hits_by_replica(url)).get(chosen, 0) - before.get(chosen, 0) < 4:
        assert time.monotonic() < deadline, f"no prefix-cache hits on {chosen}: {before} -> {after}"
        time.sleep(0.2)
    assert after.get(other, 0) == before.get(other, 0)


def test_a_killed_replica_is_replaced_and_the_endpoint_keeps_answering(endpoint) -> None:
    from ray import serve

    url, model = endpoint
    prompt = "Once upon a time there was a small server that streamed tokens to its users. " * 3
    victim = _complete(url, model, prompt).headers["x-kvserve-replica"]
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
        assert stream.headers["x-kvserve-replica"] == victim  # the same prefix, the same replica
        events = stream.iter_lines()
        assert next(events).startswith("data: {")
        ray.kill(
            ray.get_actor(f"SERVE_REPLICA::kvserve#KVServeReplica#{victim}", namespace="serve")
        )
        rest = [line for line in events if line]
    assert rest[-1] == "data: [DONE]"
    assert '"code": "replica_failed"' in rest[-2]  # its in-flight request fails cleanly
    survivors = {
        _complete(url, model, f"after {i} " * 20).headers["x-kvserve-replica"] for i in range(4)
    }
    assert victim not in survivors
    deadline = time.monotonic() + 120
    answered: set[str] = set()
    attempt = 0
    while len(answered) < 2:  # Serve starts a new replica, and the router starts using it
        assert time.monotonic() < deadline, (
            f"the killed replica was not replaced: {_replica_actors()}"
        )
        answered.add(_complete(url, model, f"later {attempt} " * 20).headers["x-kvserve-replica"])
        attempt += 1
        time.sleep(0.2)
    assert victim not in answered and answered <= _replica_actors()
    deployment = serve.status().applications["kvserve"].deployments["KVServeReplica"]
    assert deployment.replica_states.get("RUNNING", 0) == 2


def _replica_actors() -> set[str]:
    prefix = "SERVE_REPLICA::kvserve#KVServeReplica#"
    return {
        actor["name"][len(prefix) :]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(prefix)
    }

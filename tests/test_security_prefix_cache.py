"""Prefix-cache isolation: keys nobody can forge, hits that must match tokens, and salts.

A request must never be answered from KV that another request's different tokens (or
different salt) produced. The old key, Python's unkeyed tuple hash, was collided on
purpose (benchmarks/find_block_hash_collision.py found BLOCK_A and BLOCK_B); the engine
must treat that pair, and even a key function that collides on everything, as misses.
Salts (`cache_salt`, or the API key with --cache-salt-per-api-key) split the cache
into tenants, checked through the engine's and the server's hit counters.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

import kvserve.engine.core.kv_cache_manager as kv_cache
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.core.kv_cache_manager import (
    ROOT_DIGEST,
    KVCacheManager,
    hash_block,
    pack_token_ids,
    prefix_root,
)
from kvserve.engine.input_processor import split_prompt
from server_fixtures import ServerProcess, metric, scrape, server, server_checkpoint, wait_idle  # noqa: F401

OLD_ROOT_HASH = 0x6B76736572766531  # the old key's parent of every first block
# Different 16-token blocks with equal old keys: hash((OLD_ROOT_HASH, *BLOCK_A)) == hash((OLD_ROOT_HASH, *BLOCK_B)).
# python benchmarks/find_block_hash_collision.py --vocab-size 65536 --block-size 16 --log2-prefixes 25
BLOCK_A = [
    24560,
    53406,
    33639,
    45144,
    40756,
    250,
    41274,
    40288,
    13395,
    21560,
    15715,
    27495,
    40718,
    1,
    63601,
    37374,
]
BLOCK_B = [
    34018,
    64833,
    6393,
    50939,
    9877,
    12180,
    50205,
    39443,
    19343,
    6846,
    21136,
    47080,
    5201,
    14668,
    40907,
    1,
]
COLLISION_VOCAB = 65536
TAIL = [7, 8, 9]  # after the full block, so the block is looked up (one token is always computed)


def test_collision_fixture_collides_under_the_old_key_only():
    assert BLOCK_A != BLOCK_B and len(BLOCK_A) == len(BLOCK_B) == 16
    assert max(BLOCK_A + BLOCK_B) < COLLISION_VOCAB
    assert hash((OLD_ROOT_HASH, *BLOCK_A)) == hash((OLD_ROOT_HASH, *BLOCK_B))
    assert hash_block(ROOT_DIGEST, pack_token_ids(BLOCK_A)) != hash_block(
        ROOT_DIGEST, pack_token_ids(BLOCK_B)
    )


def _cache(
    bm: KVCacheManager, request_id: str, token_ids: list[int], root: bytes = ROOT_DIGEST
) -> None:
    assert bm.allocate(request_id, len(token_ids)) is not None
    bm.cache_full_blocks(request_id, token_ids, len(token_ids), root)
    bm.free(request_id)


def test_block_manager_keeps_the_old_collision_apart():
    bm = KVCacheManager(num_blocks=8, block_size=16)
    _cache(bm, "a", BLOCK_A + TAIL)
    assert bm.find_cached_prefix("b", BLOCK_B + TAIL) == []
    assert len(bm.find_cached_prefix("a2", BLOCK_A + TAIL)) == 1


def test_colliding_keys_are_misses_yet_identical_prompts_hit(monkeypatch):
    """Every block gets the same key: the stored parent digest and tokens still tell them apart."""
    monkeypatch.setattr(kv_cache, "hash_block", lambda parent, token_bytes: b"\x00" * 32)
    bm = KVCacheManager(num_blocks=16, block_size=4)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 5, 5, 6, 7, 8, 9]
    _cache(bm, "a", a)
    assert bm.find_cached_prefix("b", b) == []
    hit = bm.find_cached_prefix("a2", a)
    assert len(hit) == 1  # the first block; the second has the same key but another parent
    assert bm.prefix_cache_hits == 4


def test_salts_split_the_cache():
    roots = {prefix_root(None), prefix_root("x"), prefix_root("y"), prefix_root("x:y")}
    assert len(roots) == 4 and prefix_root(None) == ROOT_DIGEST
    bm = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 10))
    _cache(bm, "a", tokens, prefix_root("x"))
    assert bm.find_cached_prefix("other-salt", tokens, prefix_root("y")) == []
    assert bm.find_cached_prefix("no-salt", tokens) == []
    assert len(bm.find_cached_prefix("same-salt", tokens, prefix_root("x"))) == 2


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "hi", "cache_salt": 3}, "cache_salt"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one"),
        ({"prompt_token_ids": [1], "salt": "x"}, "exactly one"),
        ({"prompt": [1, 2]}, "must be a string"),
        ({"prompt_token_ids": "12"}, "list of ints"),
    ],
)
def test_bad_prompt_dicts(prompt, match):
    with pytest.raises(ValueError, match=match):
        split_prompt(prompt)


# --------------------------------------------------------------------------- the engine, end to end


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory) -> str:
    """A tiny llama whose vocabulary holds the colliding blocks' ids."""
    from checkpoints import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("wide_vocab") / "llama", "llama", vocab_size=COLLISION_VOCAB
    )


def _llm(path: str) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=16, num_kv_blocks=64)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)


def _result(out) -> tuple[list[int], list[dict[int, float]]]:
    completion = out.outputs[0]
    return completion.token_ids, [
        {t: lp.logprob for t, lp in step.items()} for step in completion.logprobs
    ]


def _run(llm: LLM, prompt) -> tuple[list[int], list[dict[int, float]]]:
    return _result(llm.generate([prompt], _params(), use_tqdm=False)[0])


def test_old_key_collision_is_not_served_from_the_other_prompts_kv(wide_vocab_dir):
    alone = _run(_llm(wide_vocab_dir), BLOCK_B + TAIL)
    llm = _llm(wide_vocab_dir)
    first = _run(llm, BLOCK_A + TAIL)
    second = _run(llm, BLOCK_B + TAIL)
    assert llm.engine.stats().prefix_cache_hits_total == 0
    assert second == alone and second != first


def test_forced_collisions_are_misses_end_to_end(wide_vocab_dir, monkeypatch):
    alone = _run(_llm(wide_vocab_dir), BLOCK_B + TAIL)
    monkeypatch.setattr(kv_cache, "hash_block", lambda parent, token_bytes: b"\x00" * 32)
    llm = _llm(wide_vocab_dir)
    first = _run(llm, BLOCK_A + TAIL)
    assert _run(llm, BLOCK_B + TAIL) == alone
    assert llm.engine.stats().prefix_cache_hits_total == 0
    again = _run(llm, BLOCK_A + TAIL)  # the same prompt still hits its own block
    assert llm.engine.stats().prefix_cache_hits_total == 16
    assert (
        again[0] == first[0]
    )  # same tokens; logprobs up to the rounding of another attention split
    for got, want in zip(again[1], first[1]):
        assert got.keys() == want.keys() and got == pytest.approx(want, abs=1e-4)


def test_cache_salt_isolates_offline(wide_vocab_dir):
    llm = _llm(wide_vocab_dir)
    prompt = BLOCK_A + BLOCK_B + TAIL

    def hits_after(item) -> int:
        before = llm.engine.stats().prefix_cache_hits_total
        llm.generate([item], _params(), use_tqdm=False)
        return llm.engine.stats().prefix_cache_hits_total - before

    assert hits_after({"prompt_token_ids": prompt, "cache_salt": "tenant-1"}) == 0
    assert hits_after({"prompt_token_ids": prompt, "cache_salt": "tenant-2"}) == 0
    assert hits_after(prompt) == 0
    assert hits_after({"prompt_token_ids": prompt, "cache_salt": "tenant-1"}) == 32
    assert hits_after(prompt) == 32
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], _params(), use_tqdm=False)


# --------------------------------------------------------------------------- a real server

KEY_1, KEY_2 = "key-one-sekrit", "key-two-sekrit"


@pytest.fixture(scope="module")
def tenant_server(server_checkpoint):  # noqa: F811
    srv = ServerProcess(
        server_checkpoint,
        "--api-key",
        KEY_1,
        "--api-key",
        KEY_2,
        "--cache-salt-per-api-key",
        "--metrics-require-api-key",
    ).wait_ready()
    yield srv
    srv.stop()


def _scrape_hits(srv: ServerProcess) -> float:
    return metric(scrape(srv.url, _auth(KEY_1)), "kvserve:prefix_cache_hits_total")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


PROMPT = list(range(10, 50))  # 40 token ids: two full 16-token blocks


def _complete(
    srv: ServerProcess, key: str, path: str = "/v1/completions", **fields
) -> httpx.Response:
    body = (
        {"messages": [{"role": "user", "content": "one two three " * 12}], "max_tokens": 2}
        if path.endswith("chat/completions")
        else {"prompt": PROMPT, "max_tokens": 2}
    )
    return httpx.post(
        srv.base_url + path.removeprefix("/v1"),
        json={**body, **fields},
        headers=_auth(key),
        timeout=60,
    )


def _new_hits(srv: ServerProcess, key: str, **fields) -> float:
    before = _scrape_hits(srv)
    response = _complete(srv, key, **fields)
    assert response.status_code == 200, response.text
    return _scrape_hits(srv) - before


def test_metrics_require_a_key(tenant_server):
    assert httpx.get(tenant_server.url + "/metrics").status_code == 401
    assert httpx.get(tenant_server.url + "/metrics", headers=_auth("wrong")).status_code == 401
    for key in (KEY_1, KEY_2):
        response = httpx.get(tenant_server.url + "/metrics", headers=_auth(key))
        assert response.status_code == 200 and "kvserve:prefix_cache_hits" in response.text
    assert httpx.get(tenant_server.url + "/health").status_code == 200


def test_each_api_key_is_a_tenant(tenant_server):
    salt = {"cache_salt": "per-key-test"}  # a salt no other test sends: starts from a cold cache
    assert _new_hits(tenant_server, KEY_1, **salt) == 0
    assert _new_hits(tenant_server, KEY_2, **salt) == 0  # same prompt, same salt, other key
    assert _new_hits(tenant_server, KEY_1, **salt) == 32
    assert _new_hits(tenant_server, KEY_2, **salt) == 32
    assert _complete(tenant_server, "wrong").status_code == 401


def test_cache_salt_isolates_through_the_server(tenant_server):
    assert _new_hits(tenant_server, KEY_1, cache_salt="salt-a") == 0
    assert _new_hits(tenant_server, KEY_1, cache_salt="salt-b") == 0
    assert _new_hits(tenant_server, KEY_1, cache_salt="salt-a") == 32
    assert _new_hits(tenant_server, KEY_1) == 0  # no salt vs salt
    assert _new_hits(tenant_server, KEY_1) == 32
    wait_idle(tenant_server.url, headers=_auth(KEY_1))


def test_chat_takes_cache_salt(tenant_server):
    def chat_hits(**fields) -> float:
        before = _scrape_hits(tenant_server)
        response = _complete(tenant_server, KEY_1, "/v1/chat/completions", **fields)
        assert response.status_code == 200, response.text
        return _scrape_hits(tenant_server) - before

    assert chat_hits(cache_salt="chat-a") == 0
    assert chat_hits(cache_salt="chat-b") == 0
    assert chat_hits(cache_salt="chat-a") > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 3, ["x"], {"a": 1}])
def test_invalid_cache_salt_is_a_400_naming_it(tenant_server, path, salt):
    response = _complete(tenant_server, KEY_1, path, cache_salt=salt)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache_salt"
    assert "Parameter 'cache_salt' must be a non-empty string if provided." in error["message"]


def test_null_cache_salt_is_no_salt(tenant_server):
    assert _complete(tenant_server, KEY_1, cache_salt=None).status_code == 200


def test_cache_salt_without_api_keys(server):  # noqa: F811
    """The plain server (no keys): clients isolate themselves with their own salts."""
    tag = uuid.uuid4().hex  # salts no earlier request on this shared server used

    def hits(**fields) -> float:
        before = metric(scrape(server.url), "kvserve:prefix_cache_hits_total")
        response = httpx.post(
            server.base_url + "/completions",
            timeout=60,
            json={"prompt": PROMPT[::-1], "max_tokens": 2, **fields},
        )
        assert response.status_code == 200, response.text
        return metric(scrape(server.url), "kvserve:prefix_cache_hits_total") - before

    assert hits(cache_salt=f"{tag}-a") == 0
    assert hits(cache_salt=f"{tag}-b") == 0
    assert hits(cache_salt=f"{tag}-a") == 32
    response = httpx.post(
        server.base_url + "/completions", json={"prompt": PROMPT, "cache_salt": ""}, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


# --------------------------------------------------------------------------- configuration and schema


def test_api_keys_options_and_their_checks(monkeypatch):
    from kvserve.server.cli import build_parser, load_config
    from kvserve.server.config import ServerConfig

    monkeypatch.setenv("KVSERVE_API_KEY", "a, b")
    assert load_config(build_parser().parse_args(["serve"])).api_key == ["a", "b"]
    config = load_config(
        build_parser().parse_args(
            ["serve", "--api-key", "c", "--api-key", "d,e", "--cache-salt-per-api-key"]
        )
    )
    assert config.api_key == ["c", "d", "e"] and config.cache_salt_per_api_key
    monkeypatch.delenv("KVSERVE_API_KEY")
    for flag in ("--cache-salt-per-api-key", "--metrics-require-api-key"):
        with pytest.raises(ValueError, match=f"{flag} needs at least one --api-key"):
            load_config(build_parser().parse_args(["serve", flag]))
    with pytest.raises(ValueError):
        ServerConfig(metrics_require_api_key=True)


def test_tenant_tags_hide_the_keys():
    from kvserve.server.middleware import tenant_tags
    from kvserve.server.validation import tenant_cache_salt

    tags = tenant_tags([KEY_1, KEY_2])
    assert len(set(tags)) == 2 and all(KEY_1 not in t and KEY_2 not in t for t in tags)
    assert tenant_tags([KEY_1]) != tags[:1]  # a fresh secret per start: tags are not the key's hash
    assert (
        tenant_cache_salt(tags[0], None)
        != tenant_cache_salt(tags[0], "x")
        != tenant_cache_salt(tags[1], "x")
    )


def test_published_schema_has_cache_salt_and_the_metrics_401():
    from kvserve.server.app import create_app
    from kvserve.server.config import ServerConfig

    doc = create_app(
        ServerConfig(stats_log_interval=0, api_key=["k"], metrics_require_api_key=True)
    ).openapi()
    assert "401" in doc["paths"]["/metrics"]["get"]["responses"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        salt = doc["components"]["schemas"][name]["properties"]["cache_salt"]
        assert {"type": "string", "minLength": 1} in salt["anyOf"] and {"type": "null"} in salt[
            "anyOf"
        ]
    doc = create_app(ServerConfig(stats_log_interval=0, api_key=["k"])).openapi()
    assert "401" not in doc["paths"]["/metrics"]["get"]["responses"]

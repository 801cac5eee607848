"""LoRA adapters through `kvserve serve`: `model` picks an adapter (the openai SDK), /v1/models lists
them, load/unload at run time behind the API key, bad adapters are 400s, unknown ones 404s."""

from __future__ import annotations

import importlib.util

import httpx
import openai
import pytest

from tests.server_fixtures import ServerProcess, metric, scrape
from tests.test_lora import ALL_TARGETS, MAX_TOKENS, make_adapter, make_prompts, reference_greedy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="peft is not installed"
)
KEY = "lora-key"


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("lora_server")
    base = make_checkpoint(root / "base", "llama")
    dirs = {
        "base": base,
        "a": make_adapter(base, root / "a", 8, seed=1, targets=ALL_TARGETS),
        "b": make_adapter(
            base, root / "b", 4, seed=2, targets=["q_proj", "v_proj"], use_rslora=True
        ),
    }
    return dirs, root


def start_server(dirs, *flags: str) -> ServerProcess:
    base = dirs["base"]
    return ServerProcess(
        base,
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"a={dirs['a']}",
        "--allow-runtime-lora-updating",
        "--api-key",
        KEY,
        "--block-size",
        "4",
        *flags,
    ).wait_ready()


@pytest.fixture(scope="module")
def lora_server(lora_dirs):
    dirs, root = lora_dirs
    srv = start_server(dirs)
    yield srv, dirs, root
    srv.stop()


def completion_logprobs(client: openai.OpenAI, model: str, prompt: list[int]) -> list[float]:
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert out.model == model
    return out.choices[0].logprobs.token_logprobs


def assert_like_reference(dirs, adapter: str | None, prompt: list[int], got: list[float]) -> None:
    tokens, logprobs, trusted = reference_greedy(
        dirs["base"], dirs[adapter] if adapter else None, tuple(prompt)
    )
    assert trusted >= MAX_TOKENS // 2
    for step in range(trusted):
        assert got[step] == pytest.approx(logprobs[step, tokens[step]].item(), abs=1e-4), (
            adapter,
            step,
        )


def test_model_picks_the_adapter_and_runtime_updates(lora_server):
    srv, dirs, _ = lora_server
    check_adapters_and_runtime_updates(srv, dirs)


def test_tensor_parallel_server_loads_and_unloads_on_every_rank(lora_dirs):
    dirs, _ = lora_dirs
    srv = start_server(dirs, "--tensor-parallel-size", "2")
    try:
        check_adapters_and_runtime_updates(srv, dirs)
    finally:
        srv.stop()


def check_adapters_and_runtime_updates(srv: ServerProcess, dirs: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY)
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "a"]
    card = client.models.retrieve("a")
    assert card.model_extra.get("parent") == "tiny"
    prompt = make_prompts([11], seed=5)[0]
    assert_like_reference(dirs, "a", prompt, completion_logprobs(client, "a", prompt))
    assert_like_reference(dirs, None, prompt, completion_logprobs(client, "tiny", prompt))
    with pytest.raises(openai.NotFoundError):
        completion_logprobs(client, "b", prompt)

    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "b", "lora_path": dirs["b"]}
    assert (
        httpx.post(srv.url + "/v1/load_lora_adapter", json=body).status_code == 401
    )  # behind the key
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert (
        httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=auth).status_code == 400
    )  # twice
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    assert_like_reference(dirs, "b", prompt, completion_logprobs(client, "b", prompt))
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == "b"
    assert metric(scrape(srv.url, auth), "kvserve:lora_requests_running", lora_name="b") == 0

    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth)
    assert r.status_code == 200, r.text
    assert (
        httpx.post(
            srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth
        ).status_code
        == 404
    )
    with pytest.raises(openai.NotFoundError):
        completion_logprobs(client, "b", prompt)


def test_bad_adapters_are_400_naming_the_field(lora_server):
    import json
    import shutil

    srv, dirs, root = lora_server
    auth = {"Authorization": f"Bearer {KEY}"}
    bad = root / "bad"
    shutil.copytree(dirs["b"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    r = httpx.post(
        srv.url + "/v1/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": str(bad)},
        headers=auth,
    )
    assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
    r = httpx.post(
        srv.url + "/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": str(root / "nope")},
        headers=auth,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = httpx.post(
        srv.url + "/v1/load_lora_adapter",
        json={"lora_name": "tiny", "lora_path": dirs["b"]},
        headers=auth,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    # weights that do not fit the base model: found when the engine reads them, a 400 for that request
    from tests.checkpoints import make_checkpoint

    other = make_checkpoint(root / "other", "llama", hidden_size=32, intermediate_size=64)
    wrong = make_adapter(other, root / "wrong", 4, seed=3, targets=["q_proj"])
    r = httpx.post(
        srv.url + "/v1/load_lora_adapter",
        json={"lora_name": "wrong", "lora_path": wrong},
        headers=auth,
    )
    assert r.status_code == 200
    r = httpx.post(
        srv.base_url + "/completions",
        json={"model": "wrong", "prompt": [1, 2], "max_tokens": 2},
        headers=auth,
    )
    assert r.status_code == 400 and "base model expects" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY)
    assert_like_reference(
        dirs, "a", [1, 2, 3], completion_logprobs(client, "a", [1, 2, 3])
    )  # still serving


def test_lora_flags(monkeypatch):
    from kvserve.server.cli import build_parser, load_config
    from kvserve.server.config import ServerConfig

    for name in ("KVSERVE_LORA_MODULES", "KVSERVE_ENABLE_LORA"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(
        [
            "serve",
            "--enable-lora",
            "--max-loras",
            "3",
            "--lora-modules",
            "a=/x",
            "b=/y",
            "--lora-modules",
            "c=/z",
        ]
    )
    config = load_config(args)
    assert config.lora_modules == ["a=/x", "b=/y", "c=/z"] and config.max_loras == 3

    with pytest.raises(ValueError, match="needs --enable-lora"):
        ServerConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="needs --enable-lora"):
        ServerConfig(allow_runtime_lora_updating=True)


def test_a_bad_lora_module_stops_the_start(tmp_path):
    from kvserve.server.app import create_app
    from kvserve.server.config import ServerConfig

    with pytest.raises(ValueError, match="--lora-modules 'a=.*is not a directory"):
        create_app(ServerConfig(enable_lora=True, lora_modules=[f"a={tmp_path / 'nope'}"]))
    with pytest.raises(ValueError, match="NAME=PATH"):
        create_app(ServerConfig(enable_lora=True, lora_modules=["just-a-path"]))

"""The API key's scheme name, the default admission queue bound, and the prompt-token counters."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_server_unit import FakeEngine

from server.config import ServerConfig
from server.middleware import bearer_token


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from checkpoints import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("robustness_tokenizer"))


# --------------------------------------------------------------------------- API key


@pytest.mark.parametrize(("header", "token"), [
    (b"Bearer k", b"k"), (b"bearer k", b"k"), (b"BEARER k", b"k"), (b"bEaReR  k", b"k"),
    (b"Basic k", b""), (b"k", b""), (b"Bearerk", b""), (b"", b""), (b"Bearer ", b""),
])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_auth_scheme_is_case_insensitive(tokenizer):
    from server.app import create_app

    config = ServerConfig(stats_log_interval=0, api_key="sekrit")
    with TestClient(create_app(config, engine=FakeEngine(tokenizer))) as client:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert client.get("/v1/models", headers={"Authorization": f"{scheme} sekrit"}).status_code == 200
        for value in ("bearer wrong", "BEARER sekri", "Basic sekrit", "sekrit", "bearer sekrit2"):
            resp = client.get("/v1/models", headers={"Authorization": value})
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", value
        assert client.get("/v1/models").status_code == 401

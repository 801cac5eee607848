"""Helpers for the server tests: a real `kvserve serve` subprocess on a free loopback port.

Servers and the checkpoint are cached per process (not per fixture definition), so test
modules that import the same session fixture share one server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 1024
_cache: dict[str, object] = {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m kvserve.server.cli serve ...` in a subprocess; `stop()` is idempotent."""

    def __init__(
        self,
        model_dir: str,
        *extra_args: str,
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = ("-m", "kvserve.server.cli"),
    ) -> None:
        """`launcher`: what runs the CLI (tests/faulty_executor.py's `fault_server_launcher` injects faults)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.log_file = tempfile.NamedTemporaryFile(
            "w+", prefix="kvserve-test-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            *launcher,
            "serve",
            "--model",
            model_dir,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--log-level",
            "info",
            *extra_args,
        ]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=self.log_file, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout_s: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def cached_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    if "checkpoint" not in _cache:
        from checkpoints import make_checkpoint

        root = tmp_path_factory.mktemp("server_checkpoint")
        _cache["checkpoint"] = make_checkpoint(
            root / "llama", "llama", max_position_embeddings=MAX_MODEL_LEN
        )
    return _cache["checkpoint"]  # type: ignore[return-value]


def cached_server(name: str, model_dir: str, *args: str) -> ServerProcess:
    server = _cache.get(name)
    if server is None:
        server = ServerProcess(model_dir, *args).wait_ready()
        _cache[name] = server
    return server  # type: ignore[return-value]


def scrape(
    url: str, headers: dict[str, str] | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` parsed with prometheus-client's parser: {(sample name, sorted labels): value}."""
    response = httpx.get(url + "/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    text = response.text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        value
        for (sample_name, sample_labels), value in samples.items()
        if sample_name == name and set(labels.items()) <= set(sample_labels)
    )


def wait_idle(url: str, timeout_s: float = 60.0, headers: dict[str, str] | None = None) -> dict:
    """Poll /metrics until nothing runs or waits and no KV block is in use; return the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url, headers)
        busy = (
            metric(samples, "kvserve:num_requests_running"),
            metric(samples, "kvserve:num_requests_waiting"),
            metric(samples, "kvserve:kv_cache_usage_perc"),
        )
        if busy == (0, 0, 0):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(
                f"server still busy after {timeout_s} s: running, waiting, kv usage = {busy}"
            )
        time.sleep(0.1)


@pytest.fixture(scope="session")
def server_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama checkpoint (context 1024) shared by every server test."""
    return cached_checkpoint(tmp_path_factory)


@pytest.fixture(scope="session")
def server(server_checkpoint: str):
    """The main server: default settings, served as `tiny`."""
    srv = cached_server("main", server_checkpoint, "--served-model-name", "tiny,tiny-alias")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def guarded_server(server_checkpoint: str):
    """A server with an API key, one sequence at a time, no queue, CORS for one origin."""
    srv = cached_server(
        "guarded",
        server_checkpoint,
        "--api-key",
        "sekrit",
        "--max-num-seqs",
        "1",
        "--max-queue",
        "0",
        "--cors-origin",
        "http://example.test",
    )
    yield srv
    srv.stop()


# Qwen3-style: ChatML, Hermes tool calls, thinking turned off by `enable_thinking: false` (an empty
# think block in the prompt), `reasoning_effort` rendered into the system turn; `open_think: true`
# opens a think block in the prompt as DeepSeek-R1's template does.
THINKING_TEMPLATE = """\
{%- if messages[0].role == 'system' or tools or reasoning_effort is defined %}<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}{% endif %}
{%- if reasoning_effort is defined %}
Reasoning effort: {{ reasoning_effort }}{% endif %}
{%- if tools %}
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>{% endif %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_think is defined and open_think %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="session")
def thinking_server(server_checkpoint: str, tmp_path_factory: pytest.TempPathFactory):
    """The tiny checkpoint with THINKING_TEMPLATE (so `--reasoning-parser auto` picks qwen3) and the
    hermes tool parser, served as `tiny`: the server of /v1/responses, /v1/messages and reasoning tests."""
    template = tmp_path_factory.mktemp("thinking_template") / "template.jinja"
    template.write_text(THINKING_TEMPLATE)
    srv = cached_server(
        "thinking",
        server_checkpoint,
        "--chat-template",
        str(template),
        "--tool-call-parser",
        "hermes",
        "--served-model-name",
        "tiny",
    )
    yield srv
    srv.stop()

"""kvserve running as the images run it, checked without a Docker engine.

- every metric the Grafana dashboard queries is exported by a running `kvserve serve`;
- `-m image` (docker/check.sh runs it where buildah cannot build the image): Dockerfile.cpu's
  builder steps (docker/install.sh) run into a fresh venv, then the image's ENTRYPOINT starts
  with the image's ENV, /health answers 200 and the image's HEALTHCHECK command passes.

The Dockerfile/PromQL parsing helpers live in tests/test_docker.py (the static checks).
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_docker import (
    CHECK_IMAGE,
    DF,
    REPO,
    args_of,
    copies,
    dashboard_queries,
    env_of,
    exec_form,
    healthcheck_cmd,
    install_runs,
    is_dockerignored,
    promql_metric_names,
    rated_metric_names,
    stage_of,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


http = CHECK_IMAGE.http  # (method, url, body=None, timeout=60) -> (status, body bytes)


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"/health not 200 within {deadline_s:.0f} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- /metrics against the dashboard


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory) -> str:
    """/metrics of a real `python -m kvserve.server.cli serve` after one completion."""
    from checkpoints import make_checkpoint

    tmp = tmp_path_factory.mktemp("docker_live")
    model = make_checkpoint(tmp / "llama", "llama")
    port, log = free_port(), tmp / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    env.update(KVSERVE_CACHE_DIR=str(tmp / "cache"), HF_HUB_OFFLINE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.server.cli",
                "serve",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(proc, port, log, deadline_s=120)
        base = f"http://127.0.0.1:{port}"
        status, body = http("GET", f"{base}/v1/models")
        assert status == 200, body
        model_id = json.loads(body)["data"][0]["id"]
        status, body = http(
            "POST",
            f"{base}/v1/completions",
            {"model": model_id, "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0},
        )
        assert status == 200, body
        status, body = http("GET", f"{base}/metrics")
        assert status == 200, body
        return body.decode()
    finally:
        stop(proc)


def test_dashboard_metrics_are_exported(live_metrics: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    # Prometheus stores samples under their sample names (foo_total, foo_bucket, foo_sum, ...),
    # and those are what PromQL names, so compare against sample names, not family names.
    sample_type = {
        sample.name: family.type
        for family in text_string_to_metric_families(live_metrics)
        for sample in family.samples
    }
    exprs = dashboard_queries()
    missing = set().union(*map(promql_metric_names, exprs)) - set(sample_type)
    assert not missing, f"dashboard queries metrics kvserve does not export: {sorted(missing)}"
    for expr in exprs:
        for name in rated_metric_names(expr):  # rate() of a gauge is a silent dashboard bug
            assert sample_type[name] in ("counter", "histogram"), (
                f"rate() over {sample_type[name]} {name}"
            )
        for name in promql_metric_names(expr):
            assert not name.endswith("_bucket") or sample_type[name] == "histogram", name


# ---------------------------------------------------------------- the image's install, without Docker


class ImageRoot:
    """A directory standing in for the image's filesystem: container path /x/y is root/x/y."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")

    def copy(self, sources: list[str], dest: str, workdir: str) -> None:
        """COPY from the build context (the repository, less what .dockerignore leaves out)."""
        dest_path = self(posixpath.join(workdir, dest))
        for src in sources:
            path = REPO / src
            if path.is_dir():
                shutil.copytree(path, dest_path, dirs_exist_ok=True, ignore=self._ignored)
            else:
                assert not is_dockerignored(src), src
                target = (
                    dest_path / path.name if dest.endswith("/") or len(sources) > 1 else dest_path
                )
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)

    @staticmethod
    def _ignored(directory: str, names: list[str]) -> set[str]:
        rel = Path(directory).resolve().relative_to(REPO).as_posix()
        return {n for n in names if is_dockerignored(posixpath.normpath(posixpath.join(rel, n)))}


@pytest.mark.image  # docker/check.sh's stand-in for the image build; not in the default run
@pytest.mark.timeout(1200)
def test_cpu_image_steps_install_and_serve(tmp_path: Path) -> None:
    """Dockerfile.cpu's builder COPY/RUN steps into a fresh venv, then its ENTRYPOINT with its ENV.

    torch comes from pip's default resolution here (TORCH_INDEX_URL empty) instead of the
    PyTorch CPU index the Dockerfile names; everything else is the Dockerfile's own recipe.
    """
    image = ImageRoot(tmp_path / "image")
    instructions = DF["kvserve-cpu"]
    builder, final = stage_of(instructions, "builder"), stage_of(instructions, None)

    workdir = "/"
    base_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVSERVE_", "PYTHON", "VIRTUAL_ENV"))
    }
    for ins in builder:
        if ins.cmd == "WORKDIR":
            workdir = posixpath.join(workdir, ins.args)
            image(workdir).mkdir(parents=True, exist_ok=True)
        elif ins.cmd == "COPY":
            ((sources, dest),) = copies([ins])
            image.copy(sources, dest, workdir)
        elif ins.cmd == "RUN" and not install_runs([ins]):
            # the builder's other RUN installs the compiler the kernels step needs (here: the host's)
            assert ins.args.startswith("apt-get update") and "g++" in ins.args, ins.args
        elif ins.cmd == "RUN":
            (argv,) = install_runs([ins])
            argv = [str(image(a)) if a.startswith("/") else a for a in argv]
            env = {**base_env, "TORCH_INDEX_URL": "", "PYTHON": sys.executable}
            result = subprocess.run(
                argv, cwd=image(workdir), env=env, capture_output=True, text=True
            )
            assert result.returncode == 0, (
                f"{ins.args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )

    # The runtime stage: COPY --from=builder keeps the venv where it is; the rest comes from the context.
    for sources, dest in copies(final):
        image.copy(sources, dest, "/")
    env = env_of(final, base=base_env)
    env["PATH"] = ":".join(
        str(image(p)) if image(p).exists() else p for p in env["PATH"].split(":")
    )
    for key in ("HF_HOME", "KVSERVE_CACHE_DIR", "KVSERVE_CPU_OPS_DIR"):
        env[key] = str(image(env[key]))
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    port = free_port()
    env.update(KVSERVE_HOST="127.0.0.1", KVSERVE_PORT=str(port), HF_HUB_OFFLINE="1")
    (workdir,) = args_of(final, "WORKDIR")
    image(workdir).mkdir(parents=True, exist_ok=True)

    (entrypoint,) = [exec_form(a) for a in args_of(final, "ENTRYPOINT")]
    executable = shutil.which(entrypoint[0], path=env["PATH"])
    assert executable and Path(executable).is_relative_to(image("/opt/venv")), executable
    health = healthcheck_cmd(final)
    health = [shutil.which(health[0], path=env["PATH"])] + [
        str(image(a)) if a.startswith("/") else a for a in health[1:]
    ]
    assert (
        subprocess.run(health, env=env, capture_output=True).returncode == 1
    )  # nothing listening yet

    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [executable, *entrypoint[1:]],
            cwd=image(workdir),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(proc, port, log, deadline_s=300)
        result = subprocess.run(health, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert http("GET", f"http://127.0.0.1:{port}/metrics")[0] == 200
        # the default model was built where the image's KVSERVE_CACHE_DIR points
        assert any(Path(env["KVSERVE_CACHE_DIR"]).iterdir()), log.read_text()[-2000:]
        # the kernels the builder compiled were loaded, not compiled again on start
        assert "CPU kernels unavailable" not in log.read_text()
        assert not (Path(env["KVSERVE_CACHE_DIR"]) / "cpu_ops").exists()
        (built,) = Path(env["KVSERVE_CPU_OPS_DIR"]).glob("*/kvserve_cpu_ops.so")
    finally:
        stop(proc)

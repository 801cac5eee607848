"""The checks docker/check.sh runs on a built image, and its helpers. Standard library only:
it runs on the host's python3, outside any venv.

    check_image.py run --image NAME --work DIR --buildah "buildah --root ..."
    check_image.py pip-config OUT_CONF      # prints the local paths OUT_CONF refers to
    check_image.py find-wheel PREFIX CONF   # prints a wheel named PREFIX* in CONF's find-links

`run` starts the image the way a container engine would (its ENTRYPOINT + CMD, as its USER,
in its WORKDIR, with its ENV; only the port is changed, since `buildah run --isolation chroot`
shares the host's network) and checks: the server runs as uid 1000; the HEALTHCHECK command
fails before start and passes while serving; /health, a completion and a chat completion answer;
the CPU kernels were built into the image from the same sources as this checkout and load
without a compiler; every PromQL expression of the Grafana dashboard, evaluated by a real
Prometheus scraping the server with docker/prometheus/prometheus.yml (target adapted), parses and
returns data during traffic; SIGTERM lets an open stream finish, then the server exits; the
image's size stays under a bound. Each check prints one line; the first failure stops it.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
MAX_IMAGE_BYTES = (
    1_600_000_000  # torch's CPU build is most of it; a bound, so that growth is noticed
)
SERVE_ENV = {
    # n-gram speculation on, so that the dashboard's speculative-decoding panels have data too
    "KVSERVE_SPECULATIVE_CONFIG": json.dumps({"method": "ngram", "num_speculative_tokens": 2}),
}


class CheckFailed(Exception):
    pass


def ok(what: str) -> None:
    print(f"docker/check_image.py: ok   {what}", flush=True)


def need(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)


# ---------------------------------------------------------------- pip configuration

_PATH_KEYS = ("cert", "client-cert", "find-links", "constraint", "index-url", "extra-index-url")


# Where the host's files that pip's configuration names appear inside the build's RUN steps: under
# a prefix of their own, so that no file the image installs (its CA bundle, say) is a mount point.
MOUNT_PREFIX = "/run/kvserve-check"


def pip_config_cmd(out: Path) -> None:
    """Write pip's effective configuration on this machine (files and PIP_* variables) as one
    pip.conf whose paths point under MOUNT_PREFIX, and print "HOST_PATH CONTAINER_PATH" for each
    local folder or file it names, for the build to mount."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    settings: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.split(".", 1)[-1]
        if (
            name in ("default-timeout", "disable-pip-version-check", "timeout", "retries")
            or name in _PATH_KEYS
        ):
            settings[name] = value.strip().strip("'\"")
    mounts: dict[str, str] = {}
    for name in _PATH_KEYS:
        items = []
        for item in settings.get(name, "").split():
            is_file_url = item.startswith("file://")
            path = (
                Path(item.removeprefix("file://")) if is_file_url or item.startswith("/") else None
            )
            if path is None or not path.exists():
                items.append(item)
                continue
            # a local index's pages link to files beside its simple/ folder (../../files/...)
            root = path.parent if path.name == "simple" else path
            mounts[str(root)] = MOUNT_PREFIX + str(root)
            inside = MOUNT_PREFIX + str(path)
            items.append(f"file://{inside}" if is_file_url else inside)
        if items:
            settings[name] = " ".join(items)
    conf = configparser.ConfigParser()
    conf["global"] = settings
    with out.open("w") as f:
        conf.write(f)
    for host, inside in sorted(mounts.items()):
        print(host, inside)


def find_wheel_cmd(prefix: str, conf_path: Path) -> None:
    """The first wheel named PREFIX* in the folders of CONF's find-links, as a host path."""
    conf = configparser.ConfigParser()
    conf.read(conf_path)
    for folder in conf.get("global", "find-links", fallback="").split():
        folder = Path(folder.removeprefix("file://").removeprefix(MOUNT_PREFIX))
        if folder.is_dir():
            for wheel in sorted(folder.glob(f"{prefix}*.whl")):
                print(wheel)
                return


# ---------------------------------------------------------------- HTTP


def http(method: str, url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    what: str,
    predicate,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise CheckFailed(f"{what}: the server exited with {proc.returncode}\n{tail}")
        try:
            value = predicate()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.5)
    raise CheckFailed(f"{what}: not within {timeout_s:.0f} s")


# ---------------------------------------------------------------- the image


class Image:
    """A built image, run with `buildah run` as a container engine would run it."""

    def __init__(self, buildah: list[str], name: str):
        self.buildah, self.name = buildah, name
        info = json.loads(self.bh("inspect", "--type", "image", name))
        self.config = info["Docker"]["config"]
        self.containers: list[str] = []

    def bh(self, *args: str) -> str:
        return subprocess.run(
            [*self.buildah, *args], check=True, capture_output=True, text=True
        ).stdout

    def container(self) -> str:
        ctr = self.bh("from", "--pull-never", self.name).strip()
        self.containers.append(ctr)
        return ctr

    def run_argv(self, ctr: str, command: list[str], env: dict[str, str]) -> list[str]:
        argv = [*self.buildah, "run", "--isolation", "chroot"]
        if self.config.get("User"):
            argv += ["--user", self.config["User"]]
        if self.config.get("WorkingDir"):
            argv += ["--workingdir", self.config["WorkingDir"]]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        return [*argv, ctr, "--", *command]

    def size_bytes(self) -> int:
        images = json.loads(self.bh("images", "--json", self.name))
        return (
            int(images[0]["size"])
            if isinstance(images[0]["size"], int)
            else _parse_size(images[0]["size"])
        )

    def remove(self) -> None:
        for ctr in self.containers:
            subprocess.run([*self.buildah, "rm", ctr], capture_output=True)


def _parse_size(text: str) -> int:
    number, unit = re.fullmatch(r"([\d.]+)\s*([kMGT]?B)", text.strip()).groups()
    return int(float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit])


def server_pid(port: int) -> int | None:
    """The image's ENTRYPOINT process: `kvserve serve` with KVSERVE_PORT=port in its environment."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"serve" in argv
            and any(a.endswith(b"/kvserve") for a in argv[:2])
            and f"KVSERVE_PORT={port}".encode() in environ
        ):
            return int(entry)
    return None


def uid_of(pid: int) -> int:
    line = next(
        x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:")
    )
    return int(line.split()[1])


# models/cpu_build.HOST_FLAGS: part of the host library's folder name
HOST_FLAGS = "-O2 -pthread -std=c++17 -fPIC -fvisibility=hidden -fvisibility-inlines-hidden"


def kernels_digest() -> str:
    """The folder name kvserve's models/cpu_build.py gives the host library built from this checkout
    (no torch in it: any torch shares it)."""
    csrc = REPO / "models" / "csrc"
    paths = sorted(
        [*(csrc / "host").glob("*.cpp"), *(csrc / "host").glob("*.h"), *csrc.glob("*.h")]
    )
    sources = b"".join(path.name.encode() + path.read_bytes() for path in paths)
    return "host-" + hashlib.sha256(sources + HOST_FLAGS.encode()).hexdigest()[:16]


KERNEL_PROBE = """
import json, torch
from kvserve.models import cpu_ops
library = cpu_ops.host_library()
x86 = cpu_ops.cpu_isa.machine_arch() == "x86_64"
sets = [isa for isa in cpu_ops.cpu_isa.ISAS if (isa != "neon") == x86]
print(json.dumps({"torch": torch.__version__, "folder": str(library.parent),
                  "prebuilt": library.exists() and all(cpu_ops.set_library(isa).exists() for isa in sets),
                  "loaded": cpu_ops.load(), "isa": cpu_ops.isa(),
                  "compiler": __import__("shutil").which("g++") is not None}))
"""


# ---------------------------------------------------------------- Prometheus


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def grafana_substitute(expr: str, dashboard: dict, scrape_interval_s: int) -> str:
    """The expression as Grafana sends it with every variable at "All" and a short time range:
    $__interval is the datasource's scrape interval, $__rate_interval = max($__interval +
    scrape interval, 4 * scrape interval), a multi-value variable's All is its allValue."""
    rate_interval = max(2 * scrape_interval_s, 4 * scrape_interval_s)
    expr = expr.replace("$__rate_interval", f"{rate_interval}s").replace(
        "$__interval", f"{scrape_interval_s}s"
    )
    for var in dashboard.get("templating", {}).get("list", []):
        expr = expr.replace(f"${{{var['name']}}}", var.get("allValue") or ".*")
        expr = expr.replace(f"${var['name']}", var.get("allValue") or ".*")
    return expr


def prometheus_query(base: str, expr: str) -> dict:
    label_values = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    if label_values:  # a Grafana variable query: Prometheus' series API answers it
        match, label = label_values.groups()
        url = f"{base}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": match})
    else:
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, body = http("GET", url, timeout=10)
    answer = json.loads(body)
    need(
        status == 200 and answer.get("status") == "success",
        f"Prometheus refused {expr!r}: {answer}",
    )
    data = answer["data"]
    return {"result": data} if isinstance(data, list) else data


def check_prometheus(server: str, work: Path) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise CheckFailed(
            "prometheus not found (apt-get install prometheus): the dashboard's queries were not checked"
        )
    config = (DOCKER / "prometheus" / "prometheus.yml").read_text()
    need(
        "kvserve:8000" in config, "docker/prometheus/prometheus.yml no longer scrapes kvserve:8000"
    )
    scrape_s = int(re.search(r"scrape_interval:\s*(\d+)s", config).group(1))
    config_path = work / "prometheus.yml"
    config_path.write_text(config.replace("kvserve:8000", server.removeprefix("http://")))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=log,
    )
    stop = threading.Event()
    traffic = threading.Thread(target=send_traffic, args=(server, stop), daemon=True)
    try:
        wait_for(
            "Prometheus ready",
            lambda: http("GET", f"{base}/-/ready", timeout=2)[0] == 200,
            30,
            proc,
        )
        traffic.start()
        dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "kvserve.json").read_text())
        rate_window = 4 * scrape_s
        # rate() needs two samples inside its window, taken while requests run
        wait_for(
            "scrapes during traffic",
            lambda: scraped_samples(base, rate_window) >= 4,
            6 * rate_window,
        )
        exprs = dashboard_queries(dashboard)
        empty = []
        for expr in exprs:
            query = grafana_substitute(expr, dashboard, scrape_s)
            result = prometheus_query(base, query)["result"]
            if not result:
                empty.append(query)
        need(
            not empty,
            f"{len(empty)} of the dashboard's {len(exprs)} queries returned no data "
            f"during traffic: {empty}",
        )
        ok(
            f"Prometheus (scraping every {scrape_s} s with docker/prometheus/prometheus.yml): "
            f"all {len(exprs)} queries of the Grafana dashboard parse and return data"
        )
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        if traffic.is_alive():
            traffic.join(timeout=60)


def scraped_samples(base: str, window_s: int) -> int:
    result = prometheus_query(base, f'count_over_time(up{{job="kvserve"}}[{window_s}s])')["result"]
    return int(float(result[0]["value"][1])) if result else 0


def send_traffic(server: str, stop: threading.Event) -> None:
    """Completions until told to stop: a shared prefix (prefix cache hits), repetitive text
    (speculative drafts), streamed and not."""
    model = json.loads(http("GET", f"{server}/v1/models")[1])["data"][0]["id"]
    i = 0
    while not stop.is_set():
        prompt = "one two three four one two three four one two three four " * 4 + str(i % 3)
        http(
            "POST",
            f"{server}/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 16, "stream": i % 2 == 0},
            timeout=120,
        )
        i += 1


# ---------------------------------------------------------------- run


def check_run(image: Image, work: Path) -> None:
    cfg = image.config
    need(
        cfg.get("User", "").split(":")[0] == "1000",
        f"the image's USER is {cfg.get('User')!r}, not 1000",
    )
    entrypoint, cmd = cfg.get("Entrypoint") or [], cfg.get("Cmd") or []
    health = (cfg.get("Healthcheck") or {}).get("Test") or []
    need(health[:1] == ["CMD"], f"no exec-form HEALTHCHECK in the image: {health}")
    port = free_port()
    server = f"http://127.0.0.1:{port}"
    env = {"KVSERVE_PORT": str(port), **SERVE_ENV}
    serve_ctr, exec_ctr = image.container(), image.container()

    def exec_in(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            image.run_argv(exec_ctr, command, env), capture_output=True, text=True, timeout=120
        )

    before = exec_in(health[1:])
    need(
        before.returncode == 1,
        f"the HEALTHCHECK command exited {before.returncode} before the server started",
    )
    ok("HEALTHCHECK command exits 1 before the server starts")

    probe = exec_in(["python", "-c", KERNEL_PROBE])
    need(probe.returncode == 0, f"kernel probe failed: {probe.stderr[-2000:]}")
    kernels = json.loads(probe.stdout.strip().splitlines()[-1])
    expected = kernels_digest()
    need(
        Path(kernels["folder"]).name == expected,
        f"the image's kernel sources differ from this checkout's ({kernels['folder']} vs {expected})",
    )
    need(
        kernels["prebuilt"] and kernels["loaded"] and not kernels["compiler"],
        f"CPU kernels not prebuilt and loaded without a compiler: {kernels}",
    )
    ok(
        f"CPU kernels built into the image from this checkout's sources ({kernels['folder']}, every kernel set), "
        f"loaded without g++ (set {kernels['isa']})"
    )

    log_path = work / "server.log"
    log = log_path.open("w")
    started = time.monotonic()
    proc = subprocess.Popen(
        image.run_argv(serve_ctr, [*entrypoint, *cmd], env), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_for(
            "/health 200",
            lambda: http("GET", f"{server}/health", timeout=2)[0] == 200,
            300,
            proc,
            log_path,
        )
        ok(f"/health 200 {time.monotonic() - started:.1f} s after start")
        pid = server_pid(port)
        need(pid is not None, "cannot find the server's process")
        need(uid_of(pid) == 1000, f"the server runs as uid {uid_of(pid)}, not 1000")
        ok("the server runs as uid 1000")
        need(
            "CPU kernels unavailable" not in log_path.read_text(),
            "the server fell back to the PyTorch path",
        )

        model = json.loads(http("GET", f"{server}/v1/models")[1])["data"][0]["id"]
        status, body = http(
            "POST", f"{server}/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 8}
        )
        need(
            status == 200 and json.loads(body)["choices"][0]["text"],
            f"completion: {status} {body[:300]!r}",
        )
        ok("a completion answers 200")
        status, body = http(
            "POST",
            f"{server}/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )
        need(
            status == 200 and json.loads(body)["choices"][0]["message"]["content"] is not None,
            f"chat completion: {status} {body[:300]!r}",
        )
        ok("a chat completion answers 200")
        during = exec_in(health[1:])
        need(
            during.returncode == 0,
            f"the HEALTHCHECK command exited {during.returncode} while serving: {during.stderr}",
        )
        ok("HEALTHCHECK command exits 0 while serving")

        check_prometheus(server, work)
        check_sigterm_drain(server, model, pid, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

    size = image.size_bytes()
    need(
        size <= MAX_IMAGE_BYTES,
        f"the image is {size / 1e9:.2f} GB, over {MAX_IMAGE_BYTES / 1e9:.2f} GB",
    )
    ok(f"image size {size / 1e9:.2f} GB (bound {MAX_IMAGE_BYTES / 1e9:.2f} GB)")


def check_sigterm_drain(server: str, model: str, pid: int, proc: subprocess.Popen) -> None:
    """SIGTERM while a stream is open: the stream still ends normally, then the server exits."""
    body = json.dumps(
        {"model": model, "prompt": "Once", "max_tokens": 48, "stream": True, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"{server}/v1/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    finish, done, signalled = None, False, False
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if not signalled:
                os.kill(pid, signal.SIGTERM)  # the stream is open: its first chunk has arrived
                signalled = True
            if line == "data: [DONE]":
                done = True
                break
            finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
    need(
        done and finish == "length",
        f"the stream open at SIGTERM did not finish (finish_reason {finish}, [DONE] {done})",
    )
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise CheckFailed("the server did not exit within 60 s of SIGTERM") from None
    need(
        code in (0, 128 + signal.SIGTERM, -signal.SIGTERM),
        f"the server exited {code} after SIGTERM",
    )
    ok(f"SIGTERM: the open stream finished ({finish}), then the server exited ({code})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--image", required=True)
    run.add_argument("--work", type=Path, default=None)
    run.add_argument(
        "--buildah", default="buildah", help="the buildah command line, storage options included"
    )
    pip_config = sub.add_parser("pip-config")
    pip_config.add_argument("out", type=Path)
    find_wheel = sub.add_parser("find-wheel")
    find_wheel.add_argument("prefix")
    find_wheel.add_argument("conf", type=Path)
    args = parser.parse_args()
    if args.cmd == "pip-config":
        pip_config_cmd(args.out)
        return 0
    if args.cmd == "find-wheel":
        find_wheel_cmd(args.prefix, args.conf)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="kvserve-check-"))
    image = Image(shlex.split(args.buildah), args.image)
    try:
        check_run(image, work)
    except CheckFailed as exc:
        print(f"docker/check_image.py: FAILED {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        image.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())

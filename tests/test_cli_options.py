"""Every engine option is written once (`EngineArgs`) and reaches both CLIs and the environment
with the same default; the Ray options likewise (`RayServeOptions`). The sub-configs take their
defaults, types and choices from `EngineArgs`, and no other code writes an option's default again."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import pickle

import pytest

import kvserve
from kvserve.engine.config import (
    OPTIONS,
    CacheConfig,
    CoreConfig,
    EngineArgs,
    GrammarLimits,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    sub_config,
)
from kvserve.server.cli import build_parser as serve_parser
from kvserve.server.config import ServerConfig
from kvserve.server.flags import parse_settings
from kvserve.server.ray_cli import build_parser as ray_parser
from kvserve.server.ray_options import RayCluster, RayOptions, RayServeOptions

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
    assert field.metadata["help"]  # the help is written on EngineArgs
    assert ServerConfig().engine_kwargs()[field.name] == expected


def test_engine_options_reach_the_engine_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_MAX_NUM_SEQS", "7")
    config = _config_from(
        _serve_subparser(),
        ["--block-size", "8", "--attention-backend", "torch", "--kv-cache-memory", "1GiB"],
    )
    args = EngineArgs(**config.engine_kwargs())
    assert (args.max_num_seqs, args.block_size, args.attention_backend, args.kv_cache_memory) == (
        7,
        8,
        "torch",
        2**30,
    )


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
    options = parse_settings(
        RayOptions, ray_parser().parse_args(["--replicas", "3", "--ingress-replicas", "2"])
    )
    assert (options.num_replicas, options.num_ingress_replicas) == (3, 2)


# --- declared once: the sub-configs and the rest of the code derive from the declarations ----------

SUB_CONFIGS = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    CoreConfig,
    GrammarLimits,
    StructuredOutputsConfig,
    LoRAConfig,
)
# a nested sub-config; the scheduler's adapter slots (--max-loras when --enable-lora, else 0)
NOT_OPTIONS = {("StructuredOutputsConfig", "limits"), ("SchedulerConfig", "max_lora_slots")}
PARSED_OPTIONS = {
    "speculative_config"
}  # JSON, parsed into SpeculativeConfig (its own keys and defaults)


@pytest.mark.parametrize("config", SUB_CONFIGS, ids=lambda c: c.__name__)
def test_sub_configs_take_defaults_and_types_from_engine_args(config):
    for f in dataclasses.fields(config):
        if (config.__name__, f.name) in NOT_OPTIONS:
            continue
        assert f.name in OPTIONS, f"{config.__name__}.{f.name} is not an EngineArgs option"
        assert f.default is OPTIONS[f.name].default and f.type == OPTIONS[f.name].type
    derived = {
        StructuredOutputsConfig: {"limits": GrammarLimits()},
        SchedulerConfig: {"max_lora_slots": 0},
    }
    assert config() == EngineArgs().derive(config, **derived.get(config, {}))
    assert (
        pickle.loads(pickle.dumps(config())) == config()
    )  # they cross to the engine core and TP ranks


def test_every_engine_option_reaches_one_sub_config():
    owners = {
        name: [c.__name__ for c in SUB_CONFIGS if name in {f.name for f in dataclasses.fields(c)}]
        for name in OPTIONS
    }
    misplaced = {
        name: found
        for name, found in owners.items()
        if len(found) != 1 and name not in PARSED_OPTIONS
    }
    # an option in no sub-config is checked nowhere: name it (with its type, no default) in the sub-config
    # of the component that reads it; in two, it would be checked twice
    assert misplaced == {}


def test_a_sub_config_cannot_redeclare_a_default():
    class Redeclared:
        block_size: int = 8

    class Retyped:
        block_size: float

    with pytest.raises(TypeError, match="EngineArgs.block_size declares it"):
        sub_config(Redeclared)
    with pytest.raises(TypeError, match="not EngineArgs.block_size's int"):
        sub_config(Retyped)


def test_choices_are_checked_where_they_are_declared():
    with pytest.raises(
        ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"
    ):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="routing must be one of"):
        RayServeOptions(routing="random")


# Names that are options but mean something else where they have a literal default: facts found at load
# (RuntimeInfo), a tensor's device, and the block manager, a unit tested on its own (engine/core/kv_cache.py
# imports nothing from the engine).
_OTHER_MEANINGS = {
    "engine/config.py RuntimeInfo.attention_backend",
    "engine/config.py RuntimeInfo.task",
    "engine/config.py RuntimeInfo.tensor_parallel_size",
    "engine/config.py RuntimeInfo.quantization",
    "engine/worker/sampler.py from_lists.device",
    "engine/core/kv_cache_manager.py __init__.enable_prefix_caching",
}
_DECLARING_CLASSES = {"EngineArgs", "ServerConfig", "RayServeOptions", "RayCluster"}


def _literal_defaults(tree: ast.AST):
    """(owner, name, line) of each class field and function parameter with a literal default."""

    def is_literal(node: ast.AST | None) -> bool:
        return (isinstance(node, ast.Constant) and node.value is not None) or (
            isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant)
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name not in _DECLARING_CLASSES:
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and is_literal(stmt.value)
                ):
                    yield node.name, stmt.target.id, stmt.lineno
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += list(zip(args.kwonlyargs, args.kw_defaults))
            yield from (
                (node.name, arg.arg, arg.lineno) for arg, default in pairs if is_literal(default)
            )


def test_no_option_default_is_written_twice():
    """An option's default lives in its declaration only: no other field or parameter of the engine
    or the server that carries the option spells out a default of its own."""
    names = (
        set(OPTIONS)
        | set(ServerConfig.model_fields)
        | {f.name for c in (RayServeOptions, RayCluster) for f in dataclasses.fields(c)}
    )
    root = pathlib.Path(kvserve.__file__).parent
    found = [
        f"{path.relative_to(root)}:{line} {owner}.{name}"
        for folder in ("engine", "server")
        for path in sorted((root / folder).rglob("*.py"))
        for owner, name, line in _literal_defaults(ast.parse(path.read_text()))
        if name in names and f"{path.relative_to(root)} {owner}.{name}" not in _OTHER_MEANINGS
    ]
    assert found == []


def test_the_docs_flag_tables_are_generated_from_the_declarations():
    from benchmarks.flag_docs import stale_pages

    assert stale_pages() == [], "run python benchmarks/flag_docs.py"

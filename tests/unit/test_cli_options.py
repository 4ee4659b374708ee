"""One configuration source: dataclass fields -> flags, TANDEM_* variables and --config keys.

Every flag of every subcommand has a help line with its default; precedence is command line >
environment > config file > default; `tandem serve` reproduces its engine configuration in the
engine child's argv; the benchmarks build their engine configuration from the same fields.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tandem import options
from tandem.cli import build_parser
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.config_flags import engine_config_from_args


def _all_parsers(parser: argparse.ArgumentParser, path: str = "tandem"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{path} {name}")


def test_every_flag_of_every_subcommand_has_help_with_its_default():
    parser = build_parser()
    seen = 0
    for path, p in _all_parsers(parser):
        for action in p._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            seen += 1
            text = action.help or ""
            assert len(text) > 20, f"{path} {action.option_strings[0]}: no real help line"
            assert "(default: " in text, f"{path} {action.option_strings[0]}: default not shown: {text!r}"
            formatter = p._get_formatter()
            formatter._expand_help(action)  # the help renders (no stray % specifiers)
    assert seen > 150  # serve, engine, frontend, generate, chat and the bench commands


def test_help_names_the_environment_variable_and_never_a_secret(monkeypatch):
    monkeypatch.setenv("TANDEM_AUTH_TOKEN", "s3cret-token")
    text = _all_help()
    assert "TANDEM_MAX_NUM_SEQS" in text and "TANDEM_PORT" in text
    assert "s3cret-token" not in text


def _all_help() -> str:
    return "\n".join(p.format_help() for _, p in _all_parsers(build_parser()))


def test_precedence_command_line_over_environment_over_config_over_default(tmp_path):
    cfg = tmp_path / "tandem.yaml"
    cfg.write_text("max-num-seqs: 7\nblock_size: 32\nno-prefix-caching: true\nport: 6000\n")
    parser = build_parser()
    # default only
    args = options.parse_args(parser, ["engine"], environ={})
    assert (args.max_num_seqs, args.block_size, args.port) == (64, 16, 50052)
    # config file
    args = options.parse_args(build_parser(), ["engine", "--config", str(cfg)], environ={})
    assert (args.max_num_seqs, args.block_size, args.enable_prefix_caching, args.port) == (7, 32, False, 6000)
    # environment beats the file
    env = {"TANDEM_MAX_NUM_SEQS": "9", "TANDEM_NO_PREFIX_CACHING": "0"}
    args = options.parse_args(build_parser(), ["engine", "--config", str(cfg)], environ=env)
    assert (args.max_num_seqs, args.block_size, args.enable_prefix_caching) == (9, 32, True)
    # the command line beats both
    args = options.parse_args(build_parser(), ["engine", "--config", str(cfg), "--max-num-seqs", "11"], environ=env)
    assert args.max_num_seqs == 11


def test_environment_lists_booleans_and_root_flags():
    env = {"TANDEM_ENGINE": "10.0.0.1:1,10.0.0.2:2", "TANDEM_ENABLE_REFLECTION": "yes", "TANDEM_LOG_LEVEL": "debug"}
    args = options.parse_args(build_parser(), ["frontend"], environ=env)
    assert args.engine == ["10.0.0.1:1", "10.0.0.2:2"]
    assert args.enable_reflection is True
    assert args.log_level == "debug"


@pytest.mark.parametrize("argv,env,text,needle", [
    (["engine"], {"TANDEM_MAX_NUM_SEQS": "many"}, None, "TANDEM_MAX_NUM_SEQS"),
    (["engine"], {"TANDEM_DTYPE": "int3"}, None, "TANDEM_DTYPE"),
    (["engine"], {"TANDEM_ENFORCE_EAGER": "maybe"}, None, "TANDEM_ENFORCE_EAGER"),
    (["engine", "--config", "{cfg}"], {}, "max-num-seqs: 4\nwarp-drive: on\n", "warp-drive"),
    (["engine", "--config", "{cfg}"], {}, "- a list\n", "mapping"),
    (["engine", "--config", "/nonexistent/tandem.yaml"], {}, None, "/nonexistent/tandem.yaml"),
])
def test_bad_environment_or_config_values_name_their_source(tmp_path, capsys, argv, env, text, needle):
    cfg = tmp_path / "c.yaml"
    if text is not None:
        cfg.write_text(text)
    argv = [a.replace("{cfg}", str(cfg)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        options.parse_args(build_parser(), argv, environ=env)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_serve_passes_its_engine_configuration_to_the_child_unchanged():
    argv = ["serve", "--model", "dummy:tiny-qwen3", "--dtype", "float32", "--max-model-len", "512",
            "--num-kv-blocks", "40", "--cpu-kv-cache-gb", "0.25", "--no-prefix-caching", "--enforce-eager",
            "--max-num-seqs", "3", "--overlap-scheduling", "off", "--generation-config", "none", "--seed", "5"]
    serve = options.parse_args(build_parser(), argv, environ={})
    config = engine_config_from_args(serve)
    child = options.parse_args(build_parser(), ["engine", *options.engine_argv(config)], environ={})
    assert engine_config_from_args(child) == config
    assert config.cache.cpu_kv_cache_bytes == 1 << 28 and config.cache.enable_prefix_caching is False
    assert config.model.generation_config == "none" and config.scheduler.max_num_seqs == 3
    # and the defaults of the flags are the dataclasses' defaults (one source)
    defaults = engine_config_from_args(options.parse_args(build_parser(), ["engine"], environ={}))
    assert defaults == EngineConfig(ModelConfig(), CacheConfig(), SchedulerConfig())


def test_every_user_settable_engine_field_is_a_flag():
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["engine"]._actions}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                assert f.name in flags, f.name


def test_benchmarks_build_their_engine_from_the_same_fields():
    args = options.parse_args(build_parser(), ["bench", "throughput", "--max-num-seqs", "8", "--block-size", "32"],
                              environ={})
    config = engine_config_from_args(args)
    assert config.scheduler.max_num_seqs == 8 and config.cache.block_size == 32
    assert config.model.model.startswith("dummy:")  # the benchmark's own default model
    env_args = options.parse_args(build_parser(), ["bench", "serve"], environ={"TANDEM_MAX_NUM_BATCHED_TOKENS": "512"})
    assert engine_config_from_args(env_args).scheduler.max_num_batched_tokens == 512


def test_operations_doc_flag_tables_match_the_parser():
    from pathlib import Path

    from tandem.flag_docs import update_docs

    doc = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
    assert update_docs(str(doc), check=True), "run `python -m tandem.flag_docs` to regenerate the tables"


def test_config_file_lists_and_flags_before_the_subcommand(tmp_path):
    cfg = tmp_path / "frontend.yaml"
    cfg.write_text("engine: [10.0.0.1:50052, 10.0.0.2:50052]\nlog-level: warning\nworkers: 2\n")
    args = options.parse_args(build_parser(), ["frontend", "--config", str(cfg)], environ={})
    assert args.engine == ["10.0.0.1:50052", "10.0.0.2:50052"] and args.workers == 2
    assert args.log_level == "warning"


def test_serve_does_not_hand_its_own_variables_to_the_engine_child(monkeypatch):
    from tandem import cli

    monkeypatch.setenv("TANDEM_PORT", "6000")  # meant for serve's frontend
    monkeypatch.setenv("TANDEM_TLS_CERT", "/etc/frontend.pem")
    monkeypatch.setenv("TANDEM_CACHE_DIR", "/cache")  # same meaning in both processes
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "2")  # not a flag
    args = options.parse_args(build_parser(), ["serve"])
    env = cli._child_env(args.engine_parser)
    assert "TANDEM_PORT" not in env and "TANDEM_TLS_CERT" not in env
    assert env["TANDEM_CACHE_DIR"] == "/cache" and env["TANDEM_TORCH_THREADS"] == "2"
    assert args.port == 6000


def test_server_options_are_built_from_the_flag_dataclasses():
    """FrontendOptions and EngineServerOptions extend the flag classes: their defaults are the
    flags' defaults (no second declaration), and the CLI builds them with from_args."""
    from tandem import cli
    from tandem.cli_options import EngineServerArgs, FrontendServingArgs, MetricsArgs, ServerArgs
    from tandem.engine_service.api.app import EngineServerOptions
    from tandem.frontend.app import FrontendOptions

    assert issubclass(FrontendOptions, (ServerArgs, FrontendServingArgs, MetricsArgs))
    assert issubclass(EngineServerOptions, (EngineServerArgs, MetricsArgs))
    for command, cls, built in (
            ("frontend", FrontendOptions, lambda args: cli._frontend_options(args, ["e:1"])),
            ("engine", EngineServerOptions, lambda args: options.from_args(cls, args))):
        args = options.parse_args(build_parser(), [command], environ={})
        flagged = {f.name for f in dataclasses.fields(cls) if "help" in f.metadata}
        assert flagged and all(getattr(args, name) == getattr(cls(), name) for name in flagged), command
    engine = options.from_args(EngineServerOptions, options.parse_args(build_parser(), ["engine"], environ={}))
    assert (engine.host, engine.port, engine.metrics_host) == ("127.0.0.1", 50052, None)
    argv = ["frontend", "--port", "7000", "--default-max-tokens", "9", "--enable-reflection", "--tokenizer", "/t",
            "--served-model-name", "m", "--engine-transport", "mux", "--metrics-port", "9100"]
    front = cli._frontend_options(options.parse_args(build_parser(), argv, environ={}), ["e:1"])
    assert (front.port, front.default_max_tokens, front.enable_reflection, front.tokenizer, front.served_model_name,
            front.engine_transport, front.metrics_port, front.metrics_host, front.engines) == (
        7000, 9, True, "/t", "m", "mux", 9100, "0.0.0.0", ["e:1"])


def test_frontend_and_client_commands_need_no_engine_installed():
    """An install without the engine distribution (the slim frontend image): `tandem frontend`,
    `chat` and `generate` parse and build their options without importing it or torch, and the
    commands that need it are not offered."""
    import subprocess
    import sys

    code = """
import importlib.abc, sys
class NoEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("tandem.engine_service", "tandem.bench")):
            raise ModuleNotFoundError(name)  # the engine and tools distributions are not installed
sys.meta_path.insert(0, NoEngine())
from tandem import cli, options
parser = cli.build_parser()
subs = parser._subparsers._group_actions[0].choices
assert sorted(subs) == ["chat", "frontend", "generate"], sorted(subs)
front = cli._frontend_options(options.parse_args(parser, ["frontend"], environ={}), ["e:1"])
assert front.port == 50051 and front.host == "0.0.0.0"
options.parse_args(parser, ["chat", "hi", "--max-tokens", "3"], environ={})
options.parse_args(parser, ["generate", "hi", "--stream"], environ={})
bad = [m for m in sys.modules if m == "torch" or m.startswith("tandem.engine_service")]
assert not bad, bad
print("ok")
"""
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("argv,env,config,named", [
    (["serve", "--port", "70000"], {}, None, "--port"),
    (["serve", "--engine-port", "-1"], {}, None, "--engine-port"),
    (["frontend", "--engine", "127.0.0.1:99999"], {}, None, "--engine"),
    (["frontend", "--engine-connect-timeout", "nan"], {}, None, "--engine-connect-timeout"),
    (["serve", "--kv-lease-seconds", "inf"], {}, None, "--kv-lease-seconds"),
    (["chat", "hi", "--wait", "-3"], {}, None, "--wait"),
    (["engine"], {"TANDEM_PORT": "123456"}, None, "--port"),
    (["engine"], {}, "max-num-seqs: true\n", "--max-num-seqs"),
    (["engine"], {}, "port: yes\n", "--port"),
    (["serve"], {"TANDEM_DISAGGREGATED": "maybe"}, None, "TANDEM_DISAGGREGATED"),
    (["engine"], {}, "max-num-seq: 3\n", "max-num-seq"),
    (["engine"], {}, "", "cannot read it"),
])
def test_a_bad_value_is_one_line_naming_the_flag_and_exit_2(argv, env, config, named, tmp_path, capsys):
    """Ports in range, finite numbers, YAML booleans only for boolean flags, and every error from
    the command line, the environment or a config file is one line and a --help pointer (not the
    usage block), exit 2, before anything starts."""
    if config is not None:
        path = tmp_path / "tandem.yaml"
        if config:
            path.write_text(config)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(SystemExit) as exc:
        options.parse_args(build_parser(), argv, environ=env)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0] and "--help" in lines[0] and "usage:" not in lines[0]


def test_a_refused_dataclass_value_names_its_flag():
    """A config's own validation (its __post_init__) is reported against the flag whose value
    it refuses, with the value in flag units."""
    args = options.parse_args(build_parser(), ["engine", "--max-num-seqs", "0"], environ={})
    with pytest.raises(options.FlagValueError) as exc:
        options.from_args(SchedulerConfig, args)
    assert (exc.value.flag, exc.value.value) == ("--max-num-seqs", 0)
    assert str(exc.value) == "--max-num-seqs 0: max_num_seqs must be >= 1"


def test_version_and_help_list_every_bench_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        options.parse_args(build_parser(), ["--version"], environ={})
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("tandem ")
    parser = build_parser()
    top = parser.format_help()
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    names = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(names) >= 9
    flat = " ".join(top.split())
    assert all(name in flat for name in names), (list(names), top)

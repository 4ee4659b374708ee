"""One configuration source for the `tandem` command: dataclass fields become flags, environment
variables and config-file keys.

A field declares itself once, with `metadata` (see `tandem/engine_service/config.py` for the keys):
its default, its help line and, where it differs from the field name, its flag. From that:

- `add_flags(parser, cls)` adds an argparse flag per field;
- `from_args(cls, args)` builds the dataclass back from parsed arguments;
- `to_argv(obj)` writes the flags that reproduce `obj` (how `tandem serve` configures its engine);
- `finish_parser(parser)` gives every flag of every subcommand a `--config FILE` option, a help
  line with its default and the name of its environment variable;
- `parse_args(parser, argv, environ)` applies the sources in this order of precedence:
  **command line > environment (`TANDEM_<FLAG>`) > config file (`--config`, YAML) > default**.

Environment variables are named after the flag: `--max-num-seqs` is `TANDEM_MAX_NUM_SEQS`. A
boolean flag reads 1/true/yes/on or 0/false/no/off; a repeatable flag reads a comma-separated
list. A config file is a YAML mapping of flag names (dashes or underscores) to values; a key
that is not a flag of the subcommand is an error. Bearer-token flags take no `TANDEM_*` default
here: `tandem.security` reads `$TANDEM_AUTH_TOKEN` itself, after the flag and the file, and a
token never appears in `--help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "TANDEM_"
# Flags whose environment variable is read elsewhere (tandem.security), with other semantics.
_NO_ENV_DESTS = ("auth_token", "engine_auth_token")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class ConfigSourceError(ValueError):
    """A value from the environment or a config file that the flag does not accept."""


class FlagValueError(ValueError):
    """A dataclass refused the value of one of its flags when it was built: which flag (or
    flags, comma-separated, when no single one is at fault), its value and the reason."""

    def __init__(self, flag: str, value: Any, reason: str) -> None:
        super().__init__(f"{flag} {value}: {reason}" if value is not None else f"{flag}: {reason}")
        self.flag, self.value, self.reason = flag, value, reason


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and a pointer to `--help`, not the whole
    usage block: `tandem serve: error: argument --port: ... (see tandem serve --help)`, exit 2.
    Subcommand parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# -- value types: each flag's value is checked as it is parsed (command line, environment, file) -----


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (nan and inf are refused)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A duration flag's value: a finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An interval flag's value: a finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def port_number(text: str) -> int:
    """A port flag's value: an integer in 0..65535 (0: the system picks a free port)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a port number (0-65535), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0-65535), got {text!r}")
    return value


def host_port(text: str) -> str:
    """An address flag's value: HOST:PORT with a port in 1..65535 (IPv6 hosts in brackets), or
    `dns:///NAME:PORT` (every address NAME resolves to, for the flags that follow names)."""
    host, sep, port = str(text).removeprefix("dns:///").rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1-65535, got {text!r}")
    return str(text)


# -- dataclass <-> flags ------------------------------------------------------------------------------


def _cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(element type, is_list) of an annotation such as `int | None` or `list[str] | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _base_type(args[0])
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.metadata.get("flag", f.name.replace("_", "-"))


def add_flags(parser: argparse.ArgumentParser | Any, cls, defaults: Mapping[str, Any] | None = None,
              title: str | None = None, skip: tuple[str, ...] = ()) -> None:
    """Adds one flag per CLI field of dataclass `cls` (dest = the field's name); `defaults`
    overrides field defaults for this subcommand (field units, not flag units)."""
    hints = typing.get_type_hints(cls)
    target = parser.add_argument_group(title) if title else parser
    for f in _cli_fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        default = (defaults or {}).get(f.name, f.default)
        typ, is_list = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if typ is bool:
            kwargs["action"] = "store_false" if meta.get("negate") else "store_true"
            kwargs["default"] = default
        else:
            scale = meta.get("scale")
            kwargs["type"] = meta.get("parse") or (finite_float if scale or typ is float else typ)
            kwargs["default"] = default / scale if (scale and default is not None) else default
            if "choices" in meta:
                kwargs["choices"] = list(meta["choices"])
            if is_list:
                kwargs["action"] = "append"
            if "choices" not in meta:
                kwargs["metavar"] = meta.get("metavar", flag_name(f).lstrip("-").replace("-", "_").upper())
        target.add_argument(flag_name(f), **kwargs)


def from_args(cls, args: argparse.Namespace, **overrides: Any):
    """The dataclass `cls` from parsed arguments (fields without a flag keep their defaults)."""
    values: dict[str, Any] = {}
    for f in _cli_fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        scale = f.metadata.get("scale")
        if scale and value is not None:
            value = int(value * scale)
        values[f.name] = value
    values.update(overrides)
    try:
        return cls(**values)
    except FlagValueError:
        raise
    except ValueError as exc:
        raise _flag_error(cls, values, exc) from None


def _flag_error(cls, values: dict[str, Any], exc: ValueError) -> ValueError:
    """The FlagValueError of a dataclass that refused `values`: the flag whose value alone the
    class refuses, else the flags set away from their defaults (a combination is at fault);
    `exc` itself when no flag was set (the defaults are refused: not a user's error)."""
    changed = [f for f in _cli_fields(cls) if f.name in values and values[f.name] != f.default]
    for f in changed:
        try:
            cls(**{f.name: values[f.name]})
        except ValueError:
            value = values[f.name]
            scale = f.metadata.get("scale")
            shown = value / scale if scale and isinstance(value, (int, float)) else value
            return FlagValueError(flag_name(f), shown, str(exc))
        except TypeError:
            continue  # a class with required fields: cannot be tried one flag at a time
    if not changed:
        return exc
    return FlagValueError(", ".join(flag_name(f) for f in changed), None, str(exc))


def to_argv(obj) -> list[str]:
    """Flags that make `from_args` rebuild `obj` (every CLI field, defaults included)."""
    out: list[str] = []
    for f in _cli_fields(type(obj)):
        value = getattr(obj, f.name)
        name = flag_name(f)
        if isinstance(value, bool):
            if value != (bool(f.metadata.get("negate"))):
                out.append(name)
        elif value is None:
            continue
        elif isinstance(value, list):
            for item in value:
                out += [name, str(item)]
        else:
            scale = f.metadata.get("scale")
            out += [name, repr(value / scale) if scale else str(value)]
    return out


# -- engine configuration -----------------------------------------------------------------------------


def engine_argv(config) -> list[str]:
    """The flags that reproduce `config` in a `tandem engine` child process."""
    return to_argv(config.model) + to_argv(config.cache) + to_argv(config.scheduler) + to_argv(config.kv_transfer)


# -- every flag: help with default, environment, config file ------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                out.append(sub)
    return out


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, (argparse._HelpAction,
                                                                                 argparse._VersionAction))]


def env_name(action: argparse.Action) -> str | None:
    if action.dest in _NO_ENV_DESTS or action.dest == "config":
        return None
    long = max(action.option_strings, key=len)
    return ENV_PREFIX + long.lstrip("-").replace("-", "_").upper()


def _describe_default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    value = action.default
    if value is None or value == argparse.SUPPRESS:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) if not isinstance(v, tuple) else "x".join(map(str, v)) for v in value) or "none"
    return str(value)


def finish_parser(parser: argparse.ArgumentParser) -> None:
    """Adds `--config FILE` to every leaf subcommand and completes every help line with the
    flag's default and environment variable. Call once, after all flags are added."""
    for sub in _subparsers(parser):
        finish_parser(sub)
    leaf = not _subparsers(parser)
    if leaf and parser is not None and not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", metavar="FILE", default=None,
                            help="YAML file of flag values (keys are flag names); precedence: command line "
                                 "> TANDEM_* environment > this file > built-in default")
    for action in flag_actions(parser):
        if action.dest == "config":
            if "(default" not in (action.help or ""):
                action.help = (action.help or "") + " (default: none)"
            continue
        help_text = (action.help or "").replace("%(default)s", _describe_default(action))
        if "; env TANDEM_" in help_text or help_text.endswith("(default: none)"):
            continue  # already finished (a parser shared by two commands)
        described = re.search(r"\s*\(default:\s*(.*)\)\s*$", help_text)
        default = described.group(1) if described else _describe_default(action)
        help_text = help_text[:described.start()] if described else help_text
        env = env_name(action)
        action.help = (f"{help_text} (default: {default}" + (f"; env {env})" if env else ")")).replace("%", "%%")
        action.doc = (help_text.strip(), default, env)  # for `flag_table`


def _parse_value(action: argparse.Action, raw: Any, source: str) -> Any:
    """A value from the environment (a string) or a config file (YAML-typed) for `action`."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(raw, bool):
            on = raw
        elif str(raw).strip().lower() in _TRUE:
            on = True
        elif str(raw).strip().lower() in _FALSE:
            on = False
        else:
            raise ConfigSourceError(f"{source}: expected true or false, got {raw!r}")
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if isinstance(action, argparse._AppendAction):
        items = raw if isinstance(raw, list) else [x for x in str(raw).split(",") if x.strip()]
        return [_convert(action, item, source) for item in items]
    return _convert(action, raw, source)


def _convert(action: argparse.Action, raw: Any, source: str) -> Any:
    if raw is None:
        return None
    if isinstance(raw, bool):  # YAML's true/false: never a number or a name
        raise ConfigSourceError(f"{source}: invalid value {str(raw).lower()} for {action.option_strings[-1]} "
                                f"(a true/false value; this flag takes {action.metavar or 'a value'})")
    convert = action.type or str
    try:
        value = convert(raw if isinstance(raw, str) or convert in (int, float) else str(raw))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigSourceError(f"{source}: invalid value {raw!r} for {action.option_strings[-1]} ({exc})") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigSourceError(f"{source}: {value!r} is not one of {choices} ({action.option_strings[-1]})")
    return value


def load_config_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigSourceError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigSourceError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigSourceError(f"--config {path}: expected a mapping of flag names to values")
    return data


def _leaf_chain(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """The parsers from the root to the chosen subcommand."""
    chain = [parser]
    while True:
        step = None
        for action in chain[-1]._actions:
            if isinstance(action, argparse._SubParsersAction):
                step = action.choices.get(getattr(args, action.dest, None) or "")
        if step is None:
            return chain
        chain.append(step)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parses `argv` with defaults from `--config` and the environment (see the module doc)."""
    environ = os.environ if environ is None else environ
    args = parser.parse_args(argv)
    chain = _leaf_chain(parser, args)
    try:
        file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
        by_parser: list[tuple[argparse.ArgumentParser, dict[str, Any]]] = []
        known: set[str] = set()
        for p in chain:
            defaults: dict[str, Any] = {}
            for action in flag_actions(p):
                names = {o.lstrip("-") for o in action.option_strings} | {action.dest}
                names |= {n.replace("-", "_") for n in names}
                for key in list(file_values):
                    if key in names or key.replace("-", "_") in names:
                        known.add(key)
                        defaults[action.dest] = _parse_value(action, file_values[key], f"--config {args.config}: {key}")
                env = env_name(action)
                if env and env in environ:
                    defaults[action.dest] = _parse_value(action, environ[env], env)
            by_parser.append((p, defaults))
        unknown = sorted(set(file_values) - known)
        if unknown:
            raise ConfigSourceError(f"--config {args.config}: not a flag of this command: {', '.join(unknown)}")
    except ConfigSourceError as exc:
        chain[-1].error(str(exc))
    if not any(d for _, d in by_parser):
        return args
    for p, defaults in by_parser:
        p.set_defaults(**defaults)
    return parser.parse_args(argv)

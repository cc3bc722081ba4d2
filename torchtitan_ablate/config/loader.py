"""Loading a JobConfig: defaults < TOML file < CLI, every value checked against its type, then
against the rules of rules.py.

A user mistake raises ConfigError with one line naming the key, the value and what is allowed;
entry points turn it into that line on stderr and exit code 2 (see `exit_on_config_error`).
"""

import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from torchtitan_ablate.config.derived import ALTERNATIVES, pick_alternatives, resolved_warmup_steps
from torchtitan_ablate.config.errors import ConfigError, one_line, report
from torchtitan_ablate.config.job_config import JobConfig
from torchtitan_ablate.config.paths import PATH_KEYS, PATH_LIST_KEYS, resolve_toml_path, split_paths
from torchtitan_ablate.config.rules import validate
from torchtitan_ablate.config.tokenizer_default import default_tokenizer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")


class _NonFinite(ValueError):
    """A float value that is nan or +-inf (rejected for every float field)."""


def _sections() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(JobConfig)}


def field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def describe_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {describe_type(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "none"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(value: Any, tp: Any, from_cli: bool) -> Any:
    """Returns value converted to tp, or raises TypeError/ValueError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (from_cli and value in ("none", "None"))):
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, from_cli)
            except _NonFinite:
                raise
            except (TypeError, ValueError):
                continue
        raise ValueError(value)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        # TOML and the CLI both give strings or ints; "2" must match a Literal["2"] etc.
        for a in allowed:
            if str(a) == str(value):
                return a
        raise ValueError(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            raise TypeError(value)
        return [_coerce(v, item_tp, from_cli) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise TypeError(value)
    if tp is int:
        if isinstance(value, bool):
            raise TypeError(value)
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            return int(value)
        raise TypeError(value)
    if tp is float:
        if isinstance(value, bool):
            raise TypeError(value)
        if isinstance(value, (int, float)) or (from_cli and isinstance(value, str)):
            try:
                number = float(value)
            except OverflowError:  # an integer too large for a float
                raise _NonFinite(value) from None
            if not math.isfinite(number):  # nan, inf (TOML and CLI both spell them)
                raise _NonFinite(value)
            return number
        raise TypeError(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError(value)
    raise TypeError(f"unsupported config type {tp}")


def _set(config: JobConfig, section: str, key: str, value: Any, source: str) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"{source}: unknown config section [{section}]; known sections: " + ", ".join(sections)
        )
    types_ = field_types(sections[section])
    if key not in types_:
        raise ConfigError(
            f"{source}: unknown key '{section}.{key}'; keys of [{section}]: " + ", ".join(types_)
        )
    tp = types_[key]
    if f"{section}.{key}" in PATH_LIST_KEYS and source == "command line" and isinstance(value, str):
        try:
            value = split_paths(f"{section}.{key}", value)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    try:
        coerced = _coerce(value, tp, from_cli=source == "command line")
    except _NonFinite:
        raise ConfigError(
            f"{source}: {section}.{key} = {value!r} is not valid; expected a finite number "
            "(nan and inf are not allowed)"
        ) from None
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source}: {section}.{key} = {value!r} is not valid; expected {describe_type(tp)}"
        ) from None
    setattr(getattr(config, section), key, coerced)


def _parse_cli(argv: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key value`, `--section.key=value`, or a bare `--section.key` (= true)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg[2:].split("=")[0]:
            raise ConfigError(
                f"command line: cannot read argument {arg!r}; use --section.key value "
                "or --section.key=value (e.g. --training.steps 10)"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            else:
                value = "true"
        section, _, key = name.partition(".")
        out.append((section, key, value))
        i += 1
    return out


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Builds the JobConfig from defaults, the TOML named by --job.config_file, and argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = _parse_cli(argv)
    config = JobConfig()
    # The last --job.config_file wins, so `run_train.sh --job.config_file X` overrides the default.
    files = [v for s, k, v in cli if (s, k) == ("job", "config_file")]
    config_file = files[-1] if files else None
    cli_keys = {f"{section}.{key}" for section, key, _ in cli}
    recipe_keys: set[str] = set()
    if config_file is not None:
        if not os.path.isfile(config_file):
            raise ConfigError(
                f"job.config_file = {config_file!r}: no such file (give a path to a TOML "
                "recipe, e.g. train_configs/debug_model.toml)"
            )
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except (tomllib.TOMLDecodeError, OSError) as e:
            raise ConfigError(f"job.config_file = {config_file!r}: cannot read TOML: {e}") from None
        for section, body in data.items():
            if not isinstance(body, dict):
                raise ConfigError(
                    f"{config_file}: top-level key {section!r} must be a [section] table"
                )
            for key, value in body.items():
                if f"{section}.{key}" in PATH_KEYS:  # a path, or a list of them (a mixture)
                    if isinstance(value, str):
                        value = resolve_toml_path(value, config_file)
                    elif isinstance(value, list):
                        value = [
                            resolve_toml_path(v, config_file) if isinstance(v, str) else v
                            for v in value
                        ]
                _set(config, section, key, value, config_file)
                recipe_keys.add(f"{section}.{key}")
    for section, key, value in cli:
        _set(config, section, key, value, "command line")
    pick_alternatives(config, recipe_keys, cli_keys)
    default_tokenizer(config, recipe_keys | cli_keys)
    validate(config)
    return config


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(value)


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML (None values are omitted: absent means None). A value
    derived from its alternative (config/derived.py) is a comment, so that the file loads
    again: `# steps = 120  (from training.epochs)`."""
    derived = {plain: src for plain, src in ALTERNATIVES if _value(config, src) is not None}
    warmup = resolved_warmup_steps(config.lr_scheduler, config.training.steps)
    lines = []
    for f in dataclasses.fields(config):
        lines.append(f"[{f.name}]")
        for k, v in dataclasses.asdict(getattr(config, f.name)).items():
            name = f"{f.name}.{k}"
            if name in derived:
                v = warmup if name == "lr_scheduler.warmup_steps" else v
                lines.append(f"# {k} = {toml_value(v)}  (from {derived[name]})")
            elif v is not None:
                lines.append(f"{k} = {toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _value(config: JobConfig, name: str) -> Any:
    section, key = name.split(".")
    return getattr(getattr(config, section), key)


def write_config(config: JobConfig, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_toml(config))
    os.replace(tmp, path)


def check_dump_folder(path: str) -> None:
    """Creates job.dump_folder; ConfigError when it cannot be created or written (every rank
    checks, so all of them stop with the same line)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"job.dump_folder = {path!r}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"job.dump_folder = {path!r}: not writable; give a folder you can write")


@contextmanager
def exit_on_config_error(dump_folder: str | None = None) -> Iterator[None]:
    """One line on stderr and exit code 2 for a ConfigError, no traceback; the same for the other
    failures errors.one_line knows (a full disk: 2; a collective whose peer failed: 1)."""
    try:
        yield
    except BaseException as e:
        known = one_line(e, dump_folder)
        if known is None:
            raise
        report(*known)
        raise SystemExit(known[1]) from None


def run_main(main: Callable[[JobConfig], T], argv: list[str] | None = None) -> T:
    with exit_on_config_error():
        config = load_config(argv)
    with exit_on_config_error(config.job.dump_folder):
        return main(config)

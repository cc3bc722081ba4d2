"""Loading a JobConfig: defaults < TOML file < CLI, every value checked against its type.

A user mistake raises ConfigError with one line naming the key, the value and what is allowed;
entry points turn it into that line on stderr and exit code 2 (see `exit_on_config_error`).
"""

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from torchtitan_ablate.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config key, value or file; the message is the one line the user sees."""


def _sections() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(JobConfig)}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
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
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli and isinstance(value, str):
            return float(value)
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
    types_ = _field_types(sections[section])
    if key not in types_:
        raise ConfigError(
            f"{source}: unknown key '{section}.{key}'; keys of [{section}]: " + ", ".join(types_)
        )
    tp = types_[key]
    try:
        coerced = _coerce(value, tp, from_cli=source == "command line")
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source}: {section}.{key} = {value!r} is not valid; expected {_describe(tp)}"
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
                _set(config, section, key, value, config_file)
    for section, key, value in cli:
        _set(config, section, key, value, "command line")
    validate(config)
    return config


def validate(config: JobConfig) -> None:
    """Cross-field checks that single types cannot express."""

    def require(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    t = config.training
    require(t.local_batch_size >= 1, f"training.local_batch_size = {t.local_batch_size}: >= 1")
    require(t.seq_len >= 2, f"training.seq_len = {t.seq_len}: must be >= 2")
    require(t.steps >= 1, f"training.steps = {t.steps}: must be >= 1")
    require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        f"training.global_batch_size = {t.global_batch_size}: -1 or a positive multiple of "
        "local_batch_size * data-parallel degree",
    )
    require(
        t.dataset != "text" or bool(t.dataset_path),
        "training.dataset = 'text' needs training.dataset_path (a .txt/.jsonl file or folder)",
    )
    require(
        t.exit_at_step == -1 or (config.checkpoint.enable and 1 <= t.exit_at_step),
        f"training.exit_at_step = {t.exit_at_step} needs checkpoint.enable = true (the run "
        "saves there and resumes later) and a step >= 1",
    )
    require(
        t.packing != "best_fit" or t.dataset == "chat",
        f"training.packing = 'best_fit' packs whole conversations (training.dataset = 'chat'); "
        f"with dataset = {t.dataset!r} use greedy or padding",
    )
    require(config.optimizer.lr > 0, f"optimizer.lr = {config.optimizer.lr}: must be > 0")
    require(
        config.lr_scheduler.warmup_steps >= 0,
        f"lr_scheduler.warmup_steps = {config.lr_scheduler.warmup_steps}: must be >= 0",
    )
    d = config.lr_scheduler.decay_ratio
    require(d is None or 0.0 <= d <= 1.0, f"lr_scheduler.decay_ratio = {d}: must be in [0, 1]")
    require(config.metrics.log_freq >= 1, f"metrics.log_freq = {config.metrics.log_freq}: >= 1")
    require(
        config.checkpoint.interval >= 1,
        f"checkpoint.interval = {config.checkpoint.interval}: must be >= 1",
    )
    opt = config.activation_checkpoint.selective_ac_option
    require(
        opt == "op" or (opt.isdigit() and int(opt) >= 1),
        f"activation_checkpoint.selective_ac_option = {opt!r}: 'op' or a positive integer",
    )
    require(
        not (config.metrics.comm_profile and config.profiling.enable_profiling),
        "metrics.comm_profile and profiling.enable_profiling both run torch.profiler, which "
        "cannot nest: enable one of them",
    )
    require(
        config.profiling.profile_freq >= 2,
        f"profiling.profile_freq = {config.profiling.profile_freq}: must be >= 2 (one warm-up "
        "step, then the traced step)",
    )
    bad = [c for c in config.compile.components if c not in ("model", "loss")]
    require(not bad, f"compile.components = {bad}: allowed are 'model', 'loss'")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(value)


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML (None values are omitted: absent means None)."""
    lines = []
    for f in dataclasses.fields(config):
        lines.append(f"[{f.name}]")
        for k, v in dataclasses.asdict(getattr(config, f.name)).items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def write_config(config: JobConfig, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_toml(config))
    os.replace(tmp, path)


@contextmanager
def exit_on_config_error() -> Iterator[None]:
    """One line on stderr and exit code 2 for a ConfigError, no traceback."""
    try:
        yield
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run_main(main: Callable[[JobConfig], T], argv: list[str] | None = None) -> T:
    with exit_on_config_error():
        config = load_config(argv)
        return main(config)

"""Loading a JobConfig: defaults < TOML file < CLI, every value checked against its type.

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

from torchtitan_ablate.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config key, value or file; the message is the one line the user sees."""


class _NonFinite(ValueError):
    """A float value that is nan or +-inf (rejected for every float field)."""


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
    types_ = _field_types(sections[section])
    if key not in types_:
        raise ConfigError(
            f"{source}: unknown key '{section}.{key}'; keys of [{section}]: " + ", ".join(types_)
        )
    tp = types_[key]
    try:
        coerced = _coerce(value, tp, from_cli=source == "command line")
    except _NonFinite:
        raise ConfigError(
            f"{source}: {section}.{key} = {value!r} is not valid; expected a finite number "
            "(nan and inf are not allowed)"
        ) from None
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
    """Cross-field and range checks that single types cannot express: every value that would
    fail (or be silently ignored) later fails here, before a process group or model is built."""

    def require(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    def at_least(key: str, value: float, low: float, note: str = "") -> None:
        require(value >= low, f"{key} = {value}: must be >= {low}{note}")

    def unset_or_positive(key: str, value: float, unset: str) -> None:
        require(value == -1 or value > 0, f"{key} = {value}: -1 ({unset}) or > 0")

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
        t.exit_at_step <= t.steps,
        f"training.exit_at_step = {t.exit_at_step} is after the last step (training.steps = "
        f"{t.steps}) and would never stop the run: use a step in 1..{t.steps}, or -1",
    )
    require(
        t.packing != "best_fit" or t.dataset == "chat",
        f"training.packing = 'best_fit' packs whole conversations (training.dataset = 'chat'); "
        f"with dataset = {t.dataset!r} use greedy or padding",
    )
    require(
        not (t.dataset == "chat" and t.data_sharding == "rows"),
        "training.data_sharding = 'rows' is for text and synthetic data; chat (SFT) data is "
        "sharded by conversation: use data_sharding = 'documents'",
    )
    at_least("training.gc_freq", t.gc_freq, 1, " (garbage collection every n steps)")
    at_least("training.max_norm", t.max_norm, 0, " (0 turns gradient clipping off)")
    at_least("training.loss_chunk_size", t.loss_chunk_size, 0, " (0 = plain loss on full logits)")
    at_least("training.num_workers", t.num_workers, 0, " (0 = load data in the main process)")

    m = config.model
    for key in ("vocab_size", "n_layers", "num_experts"):
        value = getattr(m, key)
        require(
            value == -1 or value >= 1,
            f"model.{key} = {value}: -1 (keep the flavor's value) or >= 1",
        )
    require(
        m.moe_aux_loss_coef == -1 or m.moe_aux_loss_coef >= 0,
        f"model.moe_aux_loss_coef = {m.moe_aux_loss_coef}: -1 (keep the flavor's value) or >= 0",
    )
    at_least("model.moe_bias_update_rate", m.moe_bias_update_rate, 0, " (0 = off)")
    require(
        config.parallelism.context_parallel_degree == 1 or m.attn_backend == "auto",
        f"model.attn_backend = {m.attn_backend!r} with context_parallel_degree = "
        f"{config.parallelism.context_parallel_degree}: context parallel runs its own attention "
        "(compiled flex on CUDA, SDPA with a dense mask on CPU); set model.attn_backend = 'auto'",
    )

    o = config.optimizer
    require(o.lr > 0, f"optimizer.lr = {o.lr}: must be > 0")
    for key in ("beta1", "beta2"):  # torch.optim.Adam(W)'s own rules
        value = getattr(o, key)
        require(0.0 <= value < 1.0, f"optimizer.{key} = {value}: must be in [0, 1)")
    at_least("optimizer.eps", o.eps, 0)
    at_least("optimizer.weight_decay", o.weight_decay, 0, " (0 = no weight decay)")

    s = config.lr_scheduler
    require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps = {s.warmup_steps}: must be >= 0")
    d = s.decay_ratio
    require(d is None or 0.0 <= d <= 1.0, f"lr_scheduler.decay_ratio = {d}: must be in [0, 1]")
    require(
        0.0 <= s.min_lr_factor <= 1.0,
        f"lr_scheduler.min_lr_factor = {s.min_lr_factor}: must be in [0, 1] (the final learning "
        "rate as a fraction of optimizer.lr)",
    )

    v = config.validation
    require(
        not v.enable or t.dataset == "synthetic" or bool(v.dataset_path),
        f"validation.enable = true with training.dataset = {t.dataset!r} needs "
        "validation.dataset_path (held-out data of the same kind)",
    )
    require(
        not (t.dataset == "synthetic" and v.dataset_path),
        f"validation.dataset_path = {v.dataset_path!r} is not read with training.dataset = "
        "'synthetic' (validation uses a differently seeded stream): remove it",
    )
    at_least("validation.freq", v.freq, 1, " (validate every n steps)")
    at_least("validation.steps", v.steps, 1, " (micro-batches per validation)")
    require(
        v.local_batch_size == -1 or v.local_batch_size >= 1,
        f"validation.local_batch_size = {v.local_batch_size}: -1 (training's) or >= 1",
    )

    require(config.metrics.log_freq >= 1, f"metrics.log_freq = {config.metrics.log_freq}: >= 1")
    unset_or_positive("metrics.peak_tflops", config.metrics.peak_tflops, "look the device up")
    ck = config.checkpoint
    require(ck.interval >= 1, f"checkpoint.interval = {ck.interval}: must be >= 1")
    at_least("checkpoint.keep_latest_k", ck.keep_latest_k, 0, " (0 keeps every checkpoint)")
    me = config.memory_estimation
    unset_or_positive(
        "memory_estimation.device_memory_gib", me.device_memory_gib, "the detected GPU, else 80"
    )
    require(
        me.world_size == -1 or me.world_size >= 1,
        f"memory_estimation.world_size = {me.world_size}: -1 (from the environment) or >= 1",
    )
    at_least("memory_estimation.ep_imbalance", me.ep_imbalance, 1, " (1 = balanced routing)")

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
    require(
        not config.compile.enable or bool(config.compile.components),
        "compile.enable = true with compile.components = [] compiles nothing: list 'model' "
        "and/or 'loss', or set compile.enable = false",
    )

    f8 = config.float8
    if f8.enable:  # the rules of distributed/float8.py, checked before anything is built
        require(
            not f8.enable_fsdp_float8_all_gather or f8.recipe == "tensorwise",
            f"float8.enable_fsdp_float8_all_gather = true needs float8.recipe = 'tensorwise' "
            f"(got {f8.recipe!r}): rowwise scales cannot be computed before the all-gather",
        )
        require(
            not f8.moe or f8.recipe == "rowwise",
            f"float8.moe = true needs float8.recipe = 'rowwise' (got {f8.recipe!r}): "
            "torchao's float8 grouped GEMM for experts is rowwise only",
        )

    lora = config.lora
    if lora.enable:  # the rules of models/common/lora.py apply_lora
        require(lora.rank >= 1, f"lora.rank = {lora.rank}: must be >= 1")
        require(lora.alpha > 0, f"lora.alpha = {lora.alpha}: must be > 0 (scale alpha / rank)")
        require(0.0 <= lora.dropout < 1.0, f"lora.dropout = {lora.dropout}: must be in [0, 1)")
        allowed = _lora_target_names()
        unknown = [x for x in lora.target_modules if x not in allowed]
        require(
            bool(lora.target_modules) and not unknown,
            f"lora.target_modules = {lora.target_modules}: choose one or more of {allowed}",
        )


def _lora_target_names() -> list[str]:
    """The projection names lora.target_modules accepts (models/common/lora.py's table)."""
    from torchtitan_ablate.models.common.lora import EXPERTS_TARGET, LINEAR_TARGETS

    return [*LINEAR_TARGETS, EXPERTS_TARGET]


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

"""The ablation file: one base recipe, shared overrides, named variants (TOML).

    [ablation]
    name = "zero2_vs_zero3_vs_hsdp"        # default: the file name
    description = "..."
    config_file = "train_configs/qwen3_1.7b.toml"   # the base recipe (required)
    ngpu = 4                                # processes per run (--ngpu overrides)
    seeds = [42, 43]                        # one run per seed (default: the recipe's seed)
    steps = 30                              # training.steps for every run (optional)
    throughput_warmup_steps = 3             # steps left out of the tokens/s median (default 1)
    noise_target = 0.02                     # stop a run once its median tokens/s is known
                                            #   within 2% (steps: the budget; default: off)
    profile = true                          # profile 3 steady steps per run (default true)

    [overrides]                             # section.key = value, applied to every variant
    metrics.log_freq = 1

    [variants.zero3]                        # the first variant is the baseline
    parallelism.fsdp_reshard_after_forward = "always"

    [variants.zero2]
    group = "zero2"                         # optional: line name in the batch-size plot
    ngpu = 2                                # optional: this variant's processes per run
    baseline = "zero3"                      # optional: the variant it is compared with
                                            #   (default: the first; its own name: none)
    parallelism.fsdp_reshard_after_forward = "never"

Names (the variants', [ablation] name) become folders: letters, digits, '_', '.', '-' only. A key
given twice (e.g. "training.steps" = 1 beside training.steps = 2) and a repeated seed are errors.

Precedence for one run: recipe < steps < [overrides] < variant < seed < --set. Whether a key
exists and its value is valid is checked by the config loader itself (see plan.plan_variant), so an
override of a key the engine does not have is an error, never silently dropped.
"""

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_ablate.config.paths import PATH_LIST_KEYS, escape_commas

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class AblationError(ValueError):
    """A mistake in an ablation file or in --set; the message is the one line the user sees."""


ABLATION_KEYS = {
    "name",
    "description",
    "config_file",
    "ngpu",
    "seeds",
    "steps",
    "throughput_warmup_steps",
    "noise_target",
    "profile",
}
VARIANT_META_KEYS = {"group", "description", "ngpu", "baseline"}
RUNNER_OWNED = {
    "job.dump_folder",
    "job.config_file",
    "training.seed",
    "training.throughput_warmup_steps",  # [ablation] throughput_warmup_steps
    "training.throughput_noise_target",  # [ablation] noise_target
}
# Names become folders (OUT/runs/<variant>, outputs/ablations/<name>): no separators or "..".
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any]  # "section.key" -> value
    group: str = ""
    description: str = ""
    ngpu: int | None = None
    """Processes per run of this variant (weak scaling); None: the ablation's."""
    baseline: str = ""
    """The variant this one's verdict compares with ("": the file's first variant; its own
    name: a baseline of its own, e.g. of a second model size)."""


@dataclass
class AblationSpec:
    name: str
    config_file: str
    variants: list[Variant]
    overrides: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    ngpu: int = 1
    seeds: list[int] | None = None
    steps: int | None = None
    throughput_warmup_steps: int = 1
    noise_target: float | None = None
    """Relative noise of the median tokens/s at which a run stops early (steps: the budget)."""
    profile: bool = True
    """Profile 3 steady-state steps of every run (metrics.comm_profile; overrides may turn it
    off)."""

    def run_args(self, variant: Variant, seed: int | None, sets: list[str]) -> list[str]:
        """The `--section.key=value` arguments of one run (without job.dump_folder)."""
        args = [f"--training.throughput_warmup_steps={self.throughput_warmup_steps}"]
        if self.noise_target is not None:
            args.append(f"--training.throughput_noise_target={self.noise_target!r}")
        if self.profile:
            args.append("--metrics.comm_profile=true")
        args += [] if self.steps is None else [f"--training.steps={self.steps}"]
        args += [cli_arg(k, v) for k, v in self.overrides.items()]
        args += [cli_arg(k, v) for k, v in variant.overrides.items()]
        if seed is not None:
            args.append(f"--training.seed={seed}")
        return args + [f"--{s}" for s in sets]


def cli_arg(key: str, value: Any) -> str:
    """A TOML value as the launcher's `--section.key=value` (lists comma-separated; a comma
    inside a path of a path list, a data mixture's, escaped as the loader reads it)."""
    if key in PATH_LIST_KEYS:
        paths = value if isinstance(value, list) else [value]
        value = ",".join(escape_commas(p) if isinstance(p, str) else str(p) for p in paths)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, list):
        text = ",".join(cli_arg("x", v).partition("=")[2] for v in value)
    elif isinstance(value, float):
        text = repr(value)
    else:
        text = str(value)
    return f"--{key}={text}"


def _flatten(table: dict[str, Any], where: str) -> dict[str, Any]:
    """{"training": {"seq_len": 64}} or {"training.seq_len": 64} -> {"training.seq_len": 64}."""
    out: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        # TOML allows "training.steps" = 1 beside training.steps = 2: two spellings of one key.
        if key in out:
            raise AblationError(f"{where}: {key} is given twice; keep one")
        out[key] = value

    for key, value in table.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    raise AblationError(f"{where}: {key}.{sub} is nested too deep; use section.key")
                put(f"{key}.{sub}", v)
        elif "." in key:
            put(key, value)
        else:
            raise AblationError(f"{where}: {key!r} is not a section.key override")
    for key in out:
        if key in RUNNER_OWNED:
            raise AblationError(f"{where}: {key} is set by the ablation runner, not by overrides")
    return out


def check_name(name: str, what: str) -> None:
    if not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise AblationError(
            f"{what} {name!r}: names become folders; use letters, digits, '_', '.' and '-' only"
        )


def _variant(name: str, table: Any, where: str) -> Variant:
    check_name(name, f"{where}: variant")
    if not isinstance(table, dict):
        raise AblationError(f"{where}: [variants.{name}] must be a table of section.key = value")
    for key in VARIANT_META_KEYS & set(table):
        value = table[key]
        if key == "ngpu" and not (type(value) is int and value >= 1):
            raise AblationError(f"{where}: [variants.{name}] ngpu = {value!r}: a positive integer")
        if key != "ngpu" and not isinstance(value, str):
            raise AblationError(f"{where}: [variants.{name}] {key} = {value!r}: a string")
    meta = {k: table[k] for k in VARIANT_META_KEYS & set(table)}
    rest = {k: v for k, v in table.items() if k not in meta}
    return Variant(name, _flatten(rest, f"{where} [variants.{name}]"), **meta)


def parse_sets(sets: list[str]) -> list[str]:
    """Checks `--set section.key=value` items; returns them as given."""
    for item in sets:
        key, eq, _ = item.partition("=")
        if not eq or "." not in key or key.startswith("-"):
            raise AblationError(f"--set {item!r}: use section.key=value (e.g. training.steps=5)")
        if key in RUNNER_OWNED:
            raise AblationError(f"--set {item!r}: {key} is set by the ablation runner")
    return list(sets)


def _table(data: dict[str, Any], key: str, path: Path, shape: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise AblationError(f"{path}: {key} = {value!r}: must be a table, {shape}")
    return value


def _check_head(head: dict[str, Any], path: Path) -> None:
    """The type and range of every [ablation] value."""
    bad = set(head) - ABLATION_KEYS
    if bad:
        raise AblationError(
            f"{path}: unknown [ablation] key(s) {sorted(bad)}; allowed: "
            + ", ".join(sorted(ABLATION_KEYS))
        )
    if "config_file" not in head:
        raise AblationError(f"{path}: [ablation] needs config_file (the base recipe)")
    for key in ("name", "description", "config_file"):
        value = head.get(key, "")
        if not isinstance(value, str) or (key == "config_file" and not value):
            kind = "a path (string)" if key == "config_file" else "a string"
            raise AblationError(f"{path}: [ablation] {key} = {value!r}: {kind}")
    if "name" in head:
        check_name(head["name"], f"{path}: [ablation] name")
    seeds = head.get("seeds")
    if seeds is not None and (
        not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds)
    ):
        raise AblationError(f"{path}: seeds = {seeds!r}: a non-empty list of integers")
    if seeds and len(set(seeds)) != len(seeds):
        raise AblationError(f"{path}: seeds = {seeds!r}: each seed once (one run folder each)")
    for key in ("ngpu", "steps", "throughput_warmup_steps"):
        value = head.get(key)
        low = 0 if "warmup" in key else 1
        if value is not None and (type(value) is not int or value < low):
            kind = "a non-negative integer" if low == 0 else "a positive integer"
            raise AblationError(f"{path}: {key} = {value!r}: {kind}")
    target = head.get("noise_target")
    if target is not None and (type(target) not in (int, float) or not 0 < target < 1):
        raise AblationError(
            f"{path}: noise_target = {target!r}: a fraction in (0, 1), e.g. 0.02 for 2%"
        )
    if type(head.get("profile", True)) is not bool:
        raise AblationError(f"{path}: profile = {head['profile']!r}: true or false")


def load_spec(path: str | Path) -> AblationSpec:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise AblationError(f"{path}: cannot read the ablation file: {e}") from None
    unknown = set(data) - {"ablation", "overrides", "variants"}
    if unknown:
        raise AblationError(
            f"{path}: unknown table(s) {sorted(unknown)}; allowed: [ablation], [overrides], "
            "[variants.NAME]"
        )
    head = _table(data, "ablation", path, "[ablation]")
    overrides = _table(data, "overrides", path, "[overrides] of section.key = value")
    tables = _table(data, "variants", path, "one [variants.NAME] per variant")
    _check_head(head, path)
    variants = [_variant(n, t, str(path)) for n, t in tables.items()]
    if not variants:
        raise AblationError(f"{path}: no [variants.NAME] tables; at least one is needed")
    names = [v.name for v in variants]
    for v in variants:
        if v.baseline and v.baseline not in names:
            raise AblationError(
                f"{path}: [variants.{v.name}] baseline = {v.baseline!r}: name a variant of this "
                f"file ({', '.join(names)}; its own name makes it a baseline)"
            )
    return AblationSpec(
        name=head.get("name", path.stem),
        description=head.get("description", ""),
        config_file=head["config_file"],
        variants=variants,
        overrides=_flatten(overrides, f"{path} [overrides]"),
        ngpu=head.get("ngpu", 1),
        seeds=head.get("seeds"),
        steps=head.get("steps"),
        throughput_warmup_steps=head.get("throughput_warmup_steps", 1),
        noise_target=None if "noise_target" not in head else float(head["noise_target"]),
        profile=head.get("profile", True),
    )

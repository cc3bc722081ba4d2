"""The one-line checks the config rules are written with (rules.py, training_rules.py)."""

from torchtitan_ablate.config.errors import ConfigError


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def at_least(key: str, value: float, low: float, note: str = "") -> None:
    require(value >= low, f"{key} = {value}: must be >= {low}{note}")


def unset_or_positive(key: str, value: float, unset: str) -> None:
    require(value == -1 or value > 0, f"{key} = {value}: -1 ({unset}) or > 0")

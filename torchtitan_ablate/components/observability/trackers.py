"""Weights & Biases, an optional extra (`pip install wandb`): the same fields as metrics.jsonl,
the resolved config, and the ablation runner's grouping (metrics.wandb_group). Rank 0 only.

The package is imported when the trainer builds its metrics (before the model), not at module
import: a run without metrics.enable_wandb never pays for it, and check_trackers has already named
`pip install wandb` at start-up when it is missing. A W&B run that cannot start (no `wandb login`,
a rejected key, no network) is one config error line, before the long model build.
"""

import importlib.util
import os
import sys
from typing import Any

from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.config.job_config import Metrics as MetricsConfig


def check_trackers(config: MetricsConfig) -> None:
    """At start-up, on every rank (all stop with the same line): the package an enabled tracker
    needs is installed. Finding it does not import it (seconds wandb costs only rank 0, later)."""
    if config.enable_wandb and "wandb" not in sys.modules:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "metrics.enable_wandb = true needs wandb, which is not installed: pip install "
                "wandb (or the project's wandb extra), or set metrics.enable_wandb = false"
            )


class WandbTracker:
    """One W&B run per launch: a resumed training run starts a new W&B run at its step."""

    def __init__(self, config: MetricsConfig, dump_folder: str, run_config: dict[str, Any]):
        import wandb

        name = config.wandb_run_name or os.path.basename(os.path.normpath(dump_folder))
        try:
            self.run = wandb.init(
                project=config.wandb_project,
                name=name,
                group=config.wandb_group or None,
                tags=list(config.wandb_tags) or None,
                mode=config.wandb_mode,
                dir=dump_folder,  # the run's files (offline: wandb/offline-run-*) stay with it
                config=run_config,
            )
        except _wandb_errors(wandb) as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ConfigError(
                f"metrics.enable_wandb = true, but W&B could not start a run ({type(e).__name__}: "
                f"{first}): run `wandb login` or set WANDB_API_KEY, or log offline with "
                "metrics.wandb_mode = offline (upload later with `wandb sync`), or set "
                "metrics.enable_wandb = false"
            ) from None

    def log(self, record: dict[str, Any]) -> None:
        """The record's numbers at its step (lists such as per-layer expert load are left out,
        as TensorBoard leaves them out)."""
        values = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _wandb_errors(wandb: Any) -> tuple[type[BaseException], ...]:
    """What wandb.init raises for a missing or rejected login or an unreachable server:
    UsageError ("api_key not configured (no-tty)"), CommError and its AuthenticationError; all
    derive from wandb.errors.Error."""
    base = getattr(getattr(wandb, "errors", None), "Error", None)
    return (base,) if isinstance(base, type) else ()

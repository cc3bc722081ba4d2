"""Settings whose meaning depends on another setting, interpreted here once: the build path,
the model recipes and the memory estimator ask these functions instead of re-deriving them."""

import math
from fractions import Fraction

from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.config.job_config import Compile, JobConfig, Training
from torchtitan_ablate.config.optim_config import LRScheduler
from torchtitan_ablate.config.parallelism_config import Parallelism

COMPILE_PARTS = ("model", "loss")

# Keys that say one thing two ways, (torchtitan's, HF's): the second, when set, derives the
# first (training.steps at start-up from the data, components/data/epochs.py; the warmup from
# the final step count, resolved_warmup_steps).
ALTERNATIVES = (
    ("training.steps", "training.epochs"),
    ("lr_scheduler.warmup_steps", "lr_scheduler.warmup_ratio"),
)


def resolved_loss_impl(training: Training) -> str:
    """training.loss_impl with "auto" resolved: chunked when loss_chunk_size > 0, else plain."""
    if training.loss_impl != "auto":
        return training.loss_impl
    return "chunked" if training.loss_chunk_size > 0 else "plain"


def resolved_reshard_after_forward(p: Parallelism) -> str:
    """parallelism.fsdp_reshard_after_forward with "default" resolved: "never" under pipeline
    parallel (as torchtitan: each micro-batch's forward would gather the part's weights again,
    and the zero-bubble schedules' weight pass needs them still gathered), else "default"
    (every block but the last resharded after forward)."""
    if p.fsdp_reshard_after_forward == "default" and p.pipeline_parallel_degree > 1:
        return "never"
    return p.fsdp_reshard_after_forward


def compiles(compile_config: Compile, part: str) -> bool:
    """Whether torch.compile applies to `part` of the step ("model": each transformer block;
    "loss": the chunked or plain loss): compile.enable and the part in compile.components."""
    assert part in COMPILE_PARTS, part
    return compile_config.enable and part in compile_config.components


def ceil_of(fraction: float, count: int) -> int:
    """ceil(fraction x count) of the decimal the user wrote: 0.07 x 100 is 7, not the 8 that
    binary floating point gives."""
    return math.ceil(Fraction(repr(fraction)) * count)


def resolved_warmup_steps(scheduler: LRScheduler, steps: int) -> int:
    """lr_scheduler.warmup_steps, or ceil(warmup_ratio x steps) when the ratio is set (HF's
    rounding)."""
    if scheduler.warmup_ratio is None:
        return scheduler.warmup_steps
    return ceil_of(scheduler.warmup_ratio, steps)


def pick_alternatives(config: JobConfig, recipe_keys: set[str], cli_keys: set[str]) -> None:
    """For each pair of ALTERNATIVES: both set by the recipe, or both on the command line, is
    one error line; the command line's choice beats the recipe's (a recipe's steps and
    --training.epochs: epochs). `*_keys`: the "section.key" names each source set."""
    for plain, derived in ALTERNATIVES:
        for keys, where in ((recipe_keys, "the recipe"), (cli_keys, "the command line")):
            if plain in keys and derived in keys:
                raise ConfigError(
                    f"{where} sets both {plain} and {derived}, which say the same thing two "
                    f"ways: keep one ({derived} derives {plain})"
                )
        if plain in cli_keys and derived in recipe_keys:
            section, key = derived.split(".")
            setattr(getattr(config, section), key, None)

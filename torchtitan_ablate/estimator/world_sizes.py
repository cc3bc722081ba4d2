"""World sizes a layout allows, found without a trace: by the layout checks and the model-state
floor (floor.py).

`smallest_world_size` is the fewest ranks at which `build.check_layout` accepts the config
(degrees, experts, batch); the estimator's layout error names it. `fewest_by_floor` climbs the
ladder start, 2*start, 4*start, ... to the first world size whose model-state floor and CUDA
context fit the card: fewer GPUs cannot fit whatever the batch or recomputation.
"""

from collections.abc import Iterator

from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.estimator.cuda_model import context_gib
from torchtitan_ablate.estimator.floor import ParamShape, StateFloor, pipeline_floor
from torchtitan_ablate.layout import build_parallel_dims, check_layout

MAX_WORLD_SIZE = 1024


def layout_valid(config: JobConfig, world_size: int) -> bool:
    try:
        build_parallel_dims(config, world_size)  # the cheap part first: no model args
        check_layout(config, world_size)
    except ConfigError:
        return False
    return True


def smallest_world_size(config: JobConfig, limit: int = MAX_WORLD_SIZE) -> int | None:
    """The fewest ranks (up to limit) at which config's layout is valid; None if none is."""
    return next((n for n in range(1, limit + 1) if layout_valid(config, n)), None)


def with_smallest_world_size(error: ConfigError, config: JobConfig, world_size: int) -> ConfigError:
    """The layout error at world_size, naming the smallest world size where the layout is
    valid (unchanged when no world size would make it so)."""
    n = smallest_world_size(config)
    if n is None or n == world_size:
        return error
    at = "" if f"world size {world_size}" in str(error) else f" (at world size {world_size})"
    return ConfigError(
        f"{error}{at}; the smallest world size this layout is valid at is {n}: "
        f"--memory_estimation.world_size {n}"
    )


def ladder(start: int, limit: int = MAX_WORLD_SIZE) -> Iterator[int]:
    """start, 2*start, 4*start, ... up to limit (powers of two from start = 1)."""
    n = start
    while n <= limit:
        yield n
        n *= 2


def floor_at(config: JobConfig, params: list[ParamShape], world_size: int) -> StateFloor:
    return pipeline_floor(config, params, build_parallel_dims(config, world_size))


def floor_fits(floor: StateFloor, device_gib: float) -> bool:
    """The model state and the CUDA context fit the card (room left for activations or not)."""
    return floor.total_gib + context_gib(floor.world_size) <= device_gib


def fewest_by_floor(
    config: JobConfig, params: list[ParamShape], device_gib: float, start: int
) -> int | None:
    """The first world size of ladder(start) with a valid layout whose floor fits the card."""
    for n in ladder(start):
        if layout_valid(config, n) and floor_fits(floor_at(config, params, n), device_gib):
            return n
    return None

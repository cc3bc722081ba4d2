"""memory_estimation.fewest_gpus: the fewest GPUs of this card that fit the config, and the
fastest layout among them by a stated rule (SPEED_RULE), with few fake-tensor traces.

1. World size: the ladder L, 2L, 4L, ... from the fewest ranks the layout allows (L), in the
   layout that needs the least memory (FSDP over every rank, AC full, resharding after
   forward). A world size whose model-state floor does not fit is skipped without a trace;
   the first whose trace fits is the answer's world size. When a trace does not fit by more
   than the model state it holds, more GPUs cannot help (they shrink only the model state) and
   the search stops.
2. Layout at that world size, fastest first: per AC level (none, selective, full) the level's
   least-memory layout is traced first; if it does not leave the caching allocator its room
   (verdict.leaves_room), no layout of that level does. In the first level that does, its
   faster layouts (HSDP, the config's resharding) are traced in speed order until one leaves
   room. Where none does, the first that fits at all ("tight": expect allocator retries).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.estimator.cuda_model import context_gib
from torchtitan_ablate.estimator.estimate import estimate
from torchtitan_ablate.estimator.floor import model_state
from torchtitan_ablate.estimator.verdict import apply_overrides, leaves_room, required_gib
from torchtitan_ablate.estimator.world_sizes import (
    MAX_WORLD_SIZE,
    floor_at,
    floor_fits,
    ladder,
    layout_valid,
    smallest_world_size,
)

GPUS_PER_NODE = 8
AC_LEVELS = ("none", "selective", "full")
RESHARD_SPEED = {"never": 0, "default": 1, "always": 2}  # fewer re-gathers first
SPEED_RULE = (
    "fastest first by rule, not measurement: less recomputation first (activation "
    "checkpointing none, then selective, then full, which recomputes every block's forward); "
    "then more data-parallel replicas first (HSDP before FSDP: the per-layer all-gathers and "
    f"reduce-scatters stay inside a shard group, one node of {GPUS_PER_NODE} GPUs above "
    f"{GPUS_PER_NODE}); then fewer re-gathers first (fsdp_reshard_after_forward never, default, "
    "always). Batch, PP, TP, EP and CP degrees, compile and float8 stay the config's"
)


@dataclass(frozen=True)
class Layout:
    world_size: int
    ac: str
    replicate: int
    reshard: str

    def overrides(self) -> dict:
        return {
            "memory_estimation.world_size": self.world_size,
            "activation_checkpoint.mode": self.ac,
            "parallelism.data_parallel_replicate_degree": self.replicate,
            "parallelism.data_parallel_shard_degree": -1,
            "parallelism.fsdp_reshard_after_forward": self.reshard,
        }

    def config(self, base: JobConfig) -> JobConfig:
        return apply_overrides(base, self.overrides())

    def describe(self, config: JobConfig) -> str:
        p = config.parallelism
        pp, tp, cp = p.pipeline_parallel_degree, p.tensor_parallel_degree, p.context_parallel_degree
        shard = self.world_size // (self.replicate * pp * tp * cp)
        parts = [f"PP {pp}"] * (pp > 1)
        parts += [f"HSDP {self.replicate}x{shard}" if self.replicate > 1 else f"FSDP {shard}"]
        parts += [f"TP {tp}"] * (tp > 1)
        parts += [f"CP {cp}"] * (cp > 1)
        parts += [f"EP {p.expert_parallel_degree}"] * (p.expert_parallel_degree > 1)
        option = config.activation_checkpoint.selective_ac_option
        parts.append(f"AC {self.ac}" + (f" ({option})" if self.ac == "selective" else ""))
        parts += [f"reshard {self.reshard}"] * (self.reshard != "default")
        return ", ".join(parts)

    def flags(self, config: JobConfig) -> str:
        """The command-line flags that turn config into this layout."""
        out = []
        for key, value in self.overrides().items():
            section, name = key.split(".")
            if (
                key == "memory_estimation.world_size"
                or getattr(getattr(config, section), name) != value
            ):
                out.append(f"--{key} {value}")
        return " ".join(out)


@dataclass
class Trial:
    layout: Layout
    gib: float
    fits: bool
    traced: bool
    """False: the model-state floor alone (no trace)."""
    est: dict | None = None
    room: bool = False
    """Fits with the room the caching allocator needs (verdict.leaves_room): no retries."""

    @property
    def mark(self) -> str:
        return "yes" if self.room else "tight" if self.fits else "no"


@dataclass
class Search:
    trials: list[Trial] = field(default_factory=list)
    answer: Trial | None = None
    reason: str = ""
    """Why there is no answer."""


def fewest_gpus(
    config: JobConfig,
    device_gib: float,
    log: Callable[[str], None] = print,
    trace: Callable[[JobConfig], dict] = estimate,
) -> Search:
    """The search of the module docstring; `log` gets one line per step as it goes, `trace`
    estimates one layout (a test passes a stand-in to check the order without tracing)."""
    p, search = config.parallelism, Search()
    reshards = sorted({p.fsdp_reshard_after_forward, "default"}, key=RESHARD_SPEED.get)
    lean = Layout(1, "full", 1, reshards[-1])
    start = smallest_world_size(lean.config(config))
    if start is None:
        raise ConfigError(
            f"memory_estimation.fewest_gpus: no world size up to {MAX_WORLD_SIZE} makes this "
            "layout valid (parallelism degrees, experts, batch)"
        )
    params = model_state(config)
    log(f"fewest_gpus: the layout allows world sizes from {start}")

    def trial(layout: Layout) -> Trial:
        """The layout traced, or ruled out by its model-state floor without a trace."""
        n, cfg = layout.world_size, layout.config(config)
        floor = floor_at(cfg, params, n)
        if not floor_fits(floor, device_gib):
            search.trials.append(Trial(layout, floor.total_gib + context_gib(n), False, False))
            log(
                f"fewest_gpus: world size {n}, {layout.describe(config)}: model state alone "
                f"{floor.describe()}, not traced"
            )
            return search.trials[-1]
        t0 = time.perf_counter()
        est = trace(cfg)
        gib = required_gib(est)
        room = gib <= device_gib and leaves_room(est, device_gib)
        search.trials.append(Trial(layout, gib, gib <= device_gib, True, est, room))
        verdict = "fits" if room else "fits tightly" if gib <= device_gib else "does not fit"
        log(
            f"fewest_gpus: world size {n}, {layout.describe(config)}: {gib:.1f} GiB, "
            f"{verdict} ({time.perf_counter() - t0:.0f} s)"
        )
        return search.trials[-1]

    fitting = None
    for n in ladder(start):
        lean = Layout(n, "full", 1, reshards[-1])
        if not layout_valid(lean.config(config), n):
            continue
        if context_gib(n) >= device_gib:
            search.reason = f"the CUDA context and NCCL alone take {context_gib(n):g} GiB"
            return search
        found = trial(lean)
        if found.fits:
            fitting = found
            break
        # What more GPUs do not shrink, with the context of a world of more than one.
        state = floor_at(lean.config(config), params, n).total_gib
        rest = found.gib - state - context_gib(n) + context_gib(2 * n)
        if found.traced and rest > device_gib:
            search.reason = (
                f"no world size fits: besides the model state a GPU holds {rest:.1f} GiB "
                "(activations, gathered weights, buffers, context), which more GPUs do not "
                "shrink; lower training.local_batch_size or raise context_parallel_degree"
            )
            return search
    if fitting is None:
        search.reason = f"no world size up to {MAX_WORLD_SIZE} fits"
        return search
    search.answer = _fastest(config, fitting, reshards, trial)
    return search


def _fastest(
    config: JobConfig, lean: Trial, reshards: list[str], trial: Callable[[Layout], Trial]
) -> Trial:
    """The first layout in speed order that fits with the allocator's room at lean's world
    size, else the first that fits at all (lean fits)."""
    n, recipe_r = lean.layout.world_size, config.parallelism.data_parallel_replicate_degree
    replicas = {1, recipe_r}
    if n > GPUS_PER_NODE and n % GPUS_PER_NODE == 0:
        replicas.add(n // GPUS_PER_NODE)  # one replica per node
    tight = None
    for ac in AC_LEVELS:
        ordered = [
            Layout(n, ac, r, reshard)
            for r in sorted(replicas, reverse=True)
            for reshard in reshards
            if layout_valid(Layout(n, ac, r, reshard).config(config), n)
        ]
        least = ordered[-1]  # FSDP over every rank, the most re-gathers: the least memory
        base = lean if least == lean.layout else trial(least)
        if not base.room:  # then no layout of this level leaves room
            tight = tight or (base if base.fits else None)
            continue
        for layout in ordered[:-1]:
            found = trial(layout)
            if found.room:
                return found
        return base
    return tight or lean


def format_search(search: Search, config: JobConfig, device_gib: float) -> str:
    rows = [
        f"fewest GPUs of {device_gib:g} GiB, and the fastest layout there",
        f"rule: {SPEED_RULE}",
        f"{'world':>5}  {'layout':<44}{'GiB':>9}  fits",
    ]
    for t in search.trials:
        gib = f"{t.gib:.1f}" + ("" if t.traced else "*")
        mark = " (config's layout)" if _is_config(t.layout, config) else ""
        rows.append(
            f"{t.layout.world_size:>5}  {t.layout.describe(config) + mark:<44}{gib:>9}  {t.mark}"
        )
    if any(not t.traced for t in search.trials):
        rows.append("* model state (parameters, gradients, optimizer states) + context: not traced")
    if any(t.layout.world_size > GPUS_PER_NODE for t in search.trials):
        rows.append(f"assumption: nodes of {GPUS_PER_NODE} GPUs (HSDP: one replica per node)")
    a = search.answer
    if a is None:
        rows.append(f"answer: none; {search.reason}")
        return "\n".join(rows)
    rows.append(
        f"answer: {a.layout.world_size} GPUs, {a.layout.describe(config)}: {a.gib:.1f} GiB "
        f"predicted ({100 * (1 - a.gib / device_gib):.0f}% headroom)"
    )
    rows.append(f"  {a.layout.flags(config)}")
    if not a.room:
        rows.append(
            "  tight: the allocator needs more room than the card leaves (expect retries and "
            "a slower step); more GPUs or a smaller local_batch_size leave room"
        )
    return "\n".join(rows)


def search_json(search: Search, config: JobConfig, device_gib: float) -> dict:
    a = search.answer
    return {
        "device_memory_gib": device_gib,
        "world_size": a.layout.world_size if a else None,
        "layout": a.layout.describe(config) if a else None,
        "flags": a.layout.flags(config) if a else None,
        "peak_gib": a.gib if a else None,
        "reason": search.reason,
        "rule": SPEED_RULE,
        "gpus_per_node": GPUS_PER_NODE,
        "tried": [
            {
                "world_size": t.layout.world_size,
                "layout": t.layout.describe(config),
                "overrides": t.layout.overrides(),
                "peak_gib": t.gib,
                "fits": t.fits,
                "room": t.room,
                "traced": t.traced,
            }
            for t in search.trials
        ],
    }


def _is_config(layout: Layout, config: JobConfig) -> bool:
    p = config.parallelism
    return (
        layout.ac == config.activation_checkpoint.mode
        and layout.replicate == p.data_parallel_replicate_degree
        and layout.reshard == p.fsdp_reshard_after_forward
    )

"""estimate(config): rank 0's peak memory for one training step, from fake tensors.

1. Prepare the config for the program CUDA would run (`prepare_config`): CUDA's dtypes and
   kernels; compile settings kept.
2. Per traced rank (rank 0; with pipeline parallel the first rank of each pipeline slice,
   in processes of their own when there are cores: traces.py): fake process group of N
   ranks, FakeTensorMode, fake cpu device.
3. `tracked_step`: the trainer's build path and train_step, tracked by MemoryTracker, with MoE
   routing forced (routing.py), CUDA's attention kernel stood in (cuda_model.py), the Triton
   loss kernels of loss_impl liger / cce stood in (kernel_loss.py) and, where the
   config compiles, torch.compile's backend set to `compiled.FakeInductor`: Inductor's
   partitioned graphs run on fake tensors. The build path takes these choices as one
   `build.BuildOptions`.
"""

import copy
import logging
import time

from torchtitan_ablate.build import check_layout
from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.estimator import cuda_model
from torchtitan_ablate.estimator.compiled import describe_program
from torchtitan_ablate.estimator.fake_env import resolve_world_size
from torchtitan_ablate.estimator.traces import trace_ranks
from torchtitan_ablate.estimator.tracker import CATEGORIES
from torchtitan_ablate.estimator.world_sizes import with_smallest_world_size

logger = logging.getLogger("torchtitan_ablate")
GIB = 1024**3
TARGETS = ("cuda", "cpu")


def prepare_config(config: JobConfig, target: str) -> tuple[JobConfig, list[str]]:
    """A copy of config for the program that `target` runs; and notes on what was changed."""
    cfg = copy.deepcopy(config)
    notes = []
    if cfg.parallelism.fsdp_cpu_offload:
        raise ConfigError(
            "parallelism.fsdp_cpu_offload = true is not supported by the memory estimator"
        )
    if cfg.model.attn_backend not in ("sdpa", "auto") and target == "cpu":
        raise ConfigError(
            f"model.attn_backend = {cfg.model.attn_backend!r}: the CPU estimate (validation) "
            "runs sdpa only"
        )
    if target == "cuda":
        cfg.training.cpu_mixed_precision = True  # CUDA's compute dtype on the fake cpu device
        if cfg.parallelism.enable_async_tensor_parallel:
            # Inductor's pass needs CUDA; its fused ops gather into a symmetric-memory buffer
            # the size of the all-gather output they replace.
            cfg.parallelism.enable_async_tensor_parallel = False
            notes.append("async TP modelled as TP (its fused ops' buffers as the collectives')")
        if cfg.model.attn_backend != "sdpa":
            # Every CUDA backend is a fused kernel with the same saved tensors (cuda_model.py).
            notes.append(
                f"attn_backend {cfg.model.attn_backend!r} modelled as a fused kernel "
                "(q, k, v, out, lse saved)"
            )
        cfg.model.attn_backend = "sdpa"
    return cfg, notes


def estimate(config: JobConfig, target: str = "cuda") -> dict:
    """Peak memory of the busiest rank for one steady-state training step, by category (bytes
    and GiB): rank 0, or with pipeline parallel the pipeline rank that needs the most ("ranks"
    lists each pipeline rank's peak).

    target "cuda" (the default) estimates the GPU run; "cpu" the CPU run of the same config (for
    validation against real CPU processes).
    """
    if target not in TARGETS:
        raise ValueError(f"target = {target!r}: one of {TARGETS}")
    start = time.perf_counter()
    world_size = resolve_world_size(config)
    try:
        check_layout(config, world_size)  # before the fake world, to name a valid world size
    except ConfigError as e:
        raise with_smallest_world_size(e, config, world_size) from None
    cfg, notes = prepare_config(config, target)
    # Pipeline ranks run different programs (their own parts, the schedule's micro-batches in
    # flight): each is traced as the first rank of its pipeline slice (pp is the outermost mesh
    # dimension); the others are alike.
    pp = config.parallelism.pipeline_parallel_degree
    first_ranks = [r * world_size // pp for r in range(pp)]
    traced = trace_ranks(config, cfg, target, world_size, first_ranks)
    busiest = max(traced, key=lambda t: t.peak)
    moe = any("moe" in k for k in busiest.module_activations)
    me = config.memory_estimation
    assumption = "all ranks symmetric (same shapes on every rank)"
    if busiest.ep_enabled and config.debug.moe_force_load_balance:
        assumption = "EP: the run's round-robin routing (debug.moe_force_load_balance)"
    elif busiest.ep_enabled:
        assumption = (
            f"EP: balanced routing (each expert T*k/E tokens); rank 0 receives "
            f"{me.ep_imbalance:g}x the mean rows (memory_estimation.ep_imbalance)"
        )
    elif moe:
        assumption = "MoE without EP: memory does not depend on routing"
    if pp > 1:
        assumption += "; ranks of one pipeline rank alike"
    ctx = cuda_model.context_gib(world_size) if target == "cuda" else 0.0
    by_category = {k: busiest.peak_by_category[k] / GIB for k in CATEGORIES}
    ranks = [
        {
            "rank": t.rank,
            "pipeline_rank": r if pp > 1 else None,
            "peak_bytes": t.peak,
            "peak_gib": t.peak / GIB,
            "assumption": assumption,
        }
        for r, t in enumerate(traced)
    ]
    return {
        "world_size": world_size,
        "rank": busiest.rank,
        "target": target,
        "parallel_dims": busiest.parallel_dims,
        "grad_accum": busiest.grad_accum,
        "peak_bytes": busiest.peak,
        "peak_gib": busiest.peak / GIB,
        "context_gib": ctx,
        "by_category": by_category,
        "peak_where": busiest.peak_where,
        "top_modules": _top_modules(busiest.module_activations),
        "ranks": ranks,
        "notes": notes,
        "program": describe_program(cfg, busiest.graphs),
        "n_params": busiest.n_params,
        "moe": moe,
        "expert_parallel": busiest.ep_enabled,
        "seconds": time.perf_counter() - start,
    }


def _top_modules(per_module: dict[str, int], k: int = 10) -> list[dict]:
    top = sorted(per_module.items(), key=lambda kv: -kv[1])[:k]
    return [{"module": name or "(top level)", "gib": n / GIB} for name, n in top]

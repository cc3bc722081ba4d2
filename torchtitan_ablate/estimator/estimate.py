"""estimate(config): rank 0's peak memory for one training step, from fake tensors.

1. Prepare the config for the program CUDA would run (`prepare_config`): CUDA's dtypes and
   kernels; compile settings kept.
2. In one process: fake process group of N ranks (rank 0), FakeTensorMode, fake cpu device.
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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from torchtitan_ablate.build import BuildOptions, check_layout
from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.distributed.fsdp import param_dtype
from torchtitan_ablate.estimator import cuda_model, kernel_loss
from torchtitan_ablate.estimator.compiled import FakeInductor, describe_program
from torchtitan_ablate.estimator.fake_env import fake_tensors, fake_world, resolve_world_size
from torchtitan_ablate.estimator.routing import forced_routing
from torchtitan_ablate.estimator.tracked_step import StepResult, tracked_step
from torchtitan_ablate.estimator.tracker import CATEGORIES
from torchtitan_ablate.estimator.world_sizes import with_smallest_world_size
from torchtitan_ablate.models.common.attention import resolve_backend

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
        if cfg.model.attn_backend != "sdpa":
            # Every CUDA backend is a fused kernel with the same saved tensors (cuda_model.py).
            notes.append(
                f"attn_backend {cfg.model.attn_backend!r} modelled as a fused kernel "
                "(q, k, v, out, lse saved)"
            )
        cfg.model.attn_backend = "sdpa"
    return cfg, notes


@contextmanager
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches emptied before and after: graphs traced on another fake mode (or real
    tensors) would be guarded out and count towards its recompile limit, past which blocks run
    eager silently; a generous limit covers a model whose blocks differ (MoE and dense)."""
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
            yield
    finally:
        torch._dynamo.reset()


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
    traced = [_trace(config, cfg, target, world_size, rank) for rank in first_ranks]
    busiest = max(range(pp), key=lambda r: traced[r][0].tracker.peak)
    result, backend = traced[busiest]
    tracker, pd = result.tracker, result.parallel_dims
    moe = any("moe" in k for k in tracker.module_activations)
    me = config.memory_estimation
    assumption = "all ranks symmetric (same shapes on every rank)"
    if pd.ep_enabled and config.debug.moe_force_load_balance:
        assumption = "EP: the run's round-robin routing (debug.moe_force_load_balance)"
    elif pd.ep_enabled:
        assumption = (
            f"EP: balanced routing (each expert T*k/E tokens); rank 0 receives "
            f"{me.ep_imbalance:g}x the mean rows (memory_estimation.ep_imbalance)"
        )
    elif moe:
        assumption = "MoE without EP: memory does not depend on routing"
    if pp > 1:
        assumption += "; ranks of one pipeline rank alike"
    ctx = cuda_model.context_gib(world_size) if target == "cuda" else 0.0
    by_category = {k: tracker.peak_by_category[k] / GIB for k in CATEGORIES}
    ranks = [
        {
            "rank": rank,
            "pipeline_rank": r if pp > 1 else None,
            "peak_bytes": t.tracker.peak,
            "peak_gib": t.tracker.peak / GIB,
            "assumption": assumption,
        }
        for r, (rank, (t, _)) in enumerate(zip(first_ranks, traced, strict=True))
    ]
    return {
        "world_size": world_size,
        "rank": first_ranks[busiest],
        "target": target,
        "parallel_dims": str(pd),
        "grad_accum": result.grad_accum,
        "peak_bytes": tracker.peak,
        "peak_gib": tracker.peak / GIB,
        "context_gib": ctx,
        "by_category": by_category,
        "peak_where": tracker.peak_where,
        "top_modules": _top_modules(tracker.module_activations),
        "ranks": ranks,
        "notes": notes,
        "program": describe_program(cfg, backend),
        "n_params": result.n_params,
        "moe": moe,
        "seconds": time.perf_counter() - start,
    }


def _trace(
    config: JobConfig, cfg: JobConfig, target: str, world_size: int, rank: int
) -> tuple[StepResult, FakeInductor]:
    """One tracked step of global rank `rank` in a fake world of `world_size` ranks: the
    prepared config `cfg`, with the user's `config` choosing routing and CUDA's kernels."""
    cuda = target == "cuda"
    backend = FakeInductor()
    options = BuildOptions(
        optimizer_device_type=target,
        compile_backend=backend,
        # CUDA picks grouped GEMM for bf16 experts (prepare_config gives CPU CUDA's dtypes).
        moe_grouped_mm=param_dtype(cfg.training, "cpu") == torch.bfloat16 if cuda else None,
    )
    me = config.memory_estimation
    with ExitStack() as stack:
        stack.enter_context(fake_world(world_size, rank))
        stack.enter_context(fresh_dynamo())
        stack.enter_context(forced_routing(me.ep_imbalance, config.debug.moe_force_load_balance))
        if cuda:
            native = resolve_backend(config.model.attn_backend, torch.device("cuda")) != "sdpa"
            stack.enter_context(cuda_model.cuda_attention(native))
            stack.enter_context(kernel_loss.cuda_kernel_losses())
        try:
            result = tracked_step(
                cfg,
                world_size,
                torch.device("cpu"),
                options,
                round_bytes=cuda_model.ROUND_BYTES if cuda else 1,
                tensor_mode=fake_tensors(),
            )
        except (ValueError, NotImplementedError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"memory estimation cannot run this config: {e}") from e
    return result, backend


def _top_modules(per_module: dict[str, int], k: int = 10) -> list[dict]:
    top = sorted(per_module.items(), key=lambda kv: -kv[1])[:k]
    return [{"module": name or "(top level)", "gib": n / GIB} for name, n in top]

"""The estimate's traces: one tracked step per pipeline rank (one without pipeline parallel),
each in a fake world of its own, so they can run side by side in processes of their own.

A trace holds its fake meshes, modules and Dynamo caches, none of which can leave its process;
`TraceSummary` is what the estimate reads from it (plain numbers and names).
"""

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from torchtitan_ablate.build import BuildOptions
from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.distributed.fsdp import param_dtype
from torchtitan_ablate.estimator import cuda_model, kernel_loss
from torchtitan_ablate.estimator.compiled import FakeInductor
from torchtitan_ablate.estimator.fake_env import fake_tensors, fake_world
from torchtitan_ablate.estimator.routing import forced_routing
from torchtitan_ablate.estimator.tracked_step import tracked_step
from torchtitan_ablate.models.common.attention import resolve_backend


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


@dataclass(frozen=True)
class TraceSummary:
    """One rank's tracked step, as the estimate reports it."""

    rank: int
    peak: int
    peak_by_category: dict[str, int]
    peak_where: str
    module_activations: dict[str, int]
    parallel_dims: str
    ep_enabled: bool
    grad_accum: int
    n_params: int
    graphs: int  # graphs FakeInductor traced (0: eager)


def trace_ranks(
    config: JobConfig, cfg: JobConfig, target: str, world_size: int, ranks: list[int]
) -> list[TraceSummary]:
    """trace() of each rank in `ranks`, in that order; several at once in spawned processes
    when memory_estimation.trace_processes allows (a pipeline rank's trace takes about as long
    as the whole model's, so PP 4 on one core takes four times as long)."""
    workers = config.memory_estimation.trace_processes or (os.cpu_count() or 1)
    workers = min(workers, len(ranks))
    if workers < 2:
        return [trace(config, cfg, target, world_size, rank) for rank in ranks]
    # spawn: a forked child would inherit this process's torch threads and Dynamo state.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = [pool.submit(trace, config, cfg, target, world_size, r) for r in ranks]
        return [f.result() for f in futures]


def trace(
    config: JobConfig, cfg: JobConfig, target: str, world_size: int, rank: int
) -> TraceSummary:
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
    t, pd = result.tracker, result.parallel_dims
    return TraceSummary(
        rank=rank,
        peak=t.peak,
        peak_by_category=dict(t.peak_by_category),
        peak_where=t.peak_where,
        module_activations=dict(t.module_activations),
        parallel_dims=str(pd),
        ep_enabled=pd.ep_enabled,
        grad_accum=result.grad_accum,
        n_params=result.n_params,
        graphs=backend.graphs,
    )

"""Measured peaks to check the estimator against: real CPU ranks (gloo) and, when present, CUDA.

`measure_cpu(config, world_size)` runs the estimator's own tracked step (tracked_step.py) on real
tensors in `world_size` gloo processes, with the same forced routing, and returns each rank's
tracked peak: the fake-free reference for the CPU estimate (`estimate(config, target="cpu")`).

With compile.enable, the real CPU program is Inductor's: its kernels allocate outside the
dispatcher, so the reference is the profiler's allocator events (`_inductor_cpu_peak`).

`measure_cuda(config, world_size)` runs two real training steps (on one GPU in this process, or
one spawned NCCL process per GPU), compiled where the config compiles, and returns each rank's
`active_bytes.all.peak` of the second (steady state: optimizer state resident; the figure the
trainer logs), the reference for the CUDA estimate. It needs GPUs and is not run on CPU
machines; the rank harness it shares with `measure_cpu` (`_spawn_ranks`) is.
"""

import copy
import gc
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.estimator.estimate import prepare_config
from torchtitan_ablate.estimator.routing import forced_routing
from torchtitan_ablate.estimator.tracked_step import tracked_step


def _cpu_rank(rank: int, world_size: int, store_path: str, out, config: JobConfig) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
    )
    try:
        with forced_routing(1.0, config.debug.moe_force_load_balance):
            if config.compile.enable:
                out.put((rank, (_inductor_cpu_peak(config, world_size), {})))
            else:
                result = tracked_step(config, world_size, torch.device("cpu"))
                out.put((rank, (result.tracker.peak, dict(result.tracker.peak_by_category))))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _inductor_cpu_peak(config: JobConfig, world_size: int) -> int:
    """Peak bytes of the second of two real steps compiled by Inductor on CPU. Inductor's
    kernels allocate outside the dispatcher, so the profiler's allocator events count them:
    the peak of what the step allocates, on top of what exists before it (parameters,
    optimizer state, batch), which the tracker registers."""
    from torch._C._profiler import _EventType

    from torchtitan_ablate.build import build_layout, build_run
    from torchtitan_ablate.estimator.tracked_step import create_optimizer_state, synthetic_batches
    from torchtitan_ablate.estimator.tracker import MemoryTracker
    from torchtitan_ablate.step import train_step

    device = torch.device("cpu")
    layout = build_layout(config, world_size, "cpu")
    run = build_run(config, layout, device)
    create_optimizer_state(run.model_parts, run.optimizer)
    vocab = layout.model_args.vocab_size
    train_step(run, synthetic_batches(config, layout.parallel_dims, vocab, run.grad_accum, device))
    batches = synthetic_batches(config, layout.parallel_dims, vocab, run.grad_accum, device)
    existing = MemoryTracker()
    existing.track_model(run.model_parts, run.optimizer)
    existing.track_inputs(batches)
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        train_step(run, batches)
    peak = 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.Allocation:
            peak = max(peak, event.typed[1].total_allocated)
        stack += event.children
    return existing.total + peak


def _cuda_rank(rank: int, world_size: int, store_path: str, out, config: JobConfig) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # pick_device's choice of GPU
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "nccl", store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
    )
    out.put((rank, _two_steps_peak(config, world_size)))  # destroys the group


def _spawn_ranks(target, world_size: int, config: JobConfig) -> list:
    """Runs target(rank, world_size, store_path, queue, config) in world_size spawned
    processes; returns what each rank put on the queue, in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=target, args=(r, world_size, store_path, out, config))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=900) for _ in procs]
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"a rank failed with exit code {p.exitcode}")
    return [value for _, value in sorted(results, key=lambda r: r[0])]


def measure_cpu(config: JobConfig, world_size: int) -> list[tuple[int, dict]]:
    """[(peak bytes, bytes by category)] per rank of a real gloo run of one tracked step."""
    cfg, _ = prepare_config(config, "cpu")
    return _spawn_ranks(_cpu_rank, world_size, cfg)


def measure_cuda(config: JobConfig, world_size: int = 1) -> list[int]:
    """active_bytes.all.peak per rank of the second of two real training steps: in this
    process on one GPU, else one spawned process per GPU (NCCL)."""
    if world_size == 1:
        return [_two_steps_peak(config, 1)]
    n_gpus = torch.cuda.device_count()
    if n_gpus < world_size:
        raise RuntimeError(f"{world_size} ranks need {world_size} GPUs; this machine has {n_gpus}")
    return _spawn_ranks(_cuda_rank, world_size, config)


def _two_steps_peak(config: JobConfig, world_size: int) -> int:
    """This rank's peak over its second real step (steady state: optimizer state resident)."""
    from torchtitan_ablate.build import build_layout, build_run
    from torchtitan_ablate.distributed import utils as dist_utils
    from torchtitan_ablate.estimator.tracked_step import reset_dtensor_rng, synthetic_batches
    from torchtitan_ablate.step import train_step

    cfg = copy.deepcopy(config)
    device = dist_utils.pick_device("cuda")
    reset_dtensor_rng()
    dist_utils.init_distributed(device)  # a no-op when the rank's group already exists
    run = batches = None
    try:
        layout = build_layout(cfg, world_size, "cuda")
        run = build_run(cfg, layout, device)
        for step in range(2):
            batches = synthetic_batches(
                cfg, run.parallel_dims, run.model_args.vocab_size, run.grad_accum, device
            )
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            train_step(run, batches)
        torch.cuda.synchronize()
        return torch.cuda.memory_stats()["active_bytes.all.peak"]
    finally:
        # FSDP's hooks hold reference cycles: collect them, or the next config measured in this
        # process starts with this one's model and optimizer still allocated.
        run = batches = None
        gc.collect()
        torch.cuda.empty_cache()
        dist_utils.destroy_distributed()

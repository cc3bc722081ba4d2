"""One tracked training step on the trainer's own build path (fake or real tensors alike).

`tracked_step` runs, in the current process group, build.build_layout (checks, meshes, seed) ->
build.build_run (meta build, the family's parallelize, to_empty, init, optimizer, schedule,
loss) ->
step.train_step on synthetic micro-batches of the configured shape, with a MemoryTracker around
the step only (so weight init is never counted). The estimator calls it
under a fake process group and FakeTensorMode; the validation calls it on real gloo ranks.

Steady state: the optimizer state is created before tracking (one step on zero gradients), so
the tracked step is the one every later step repeats, with Adam's moments already resident.
"""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from torchtitan_ablate.build import TRAINING_BUILD, BuildOptions, build_layout, build_run
from torchtitan_ablate.components.data.preference import synthetic_pair_keys
from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.distributed.context_parallel import place_micro_batch
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.estimator.tracker import MemoryTracker
from torchtitan_ablate.step import train_step


@dataclass
class StepResult:
    tracker: MemoryTracker
    parallel_dims: ParallelDims
    grad_accum: int
    n_params: int


def synthetic_batches(
    config: JobConfig, pd: ParallelDims, vocab_size: int, n: int, device: torch.device
) -> list[dict]:
    """n micro-batches [local_batch_size, seq_len] as the loader yields them (every packing mode
    yields document_ids and positions), then this rank's CP slice."""
    b, s = config.training.local_batch_size, config.training.seq_len
    batches = []
    for _ in range(n):
        batch = {
            "input_ids": torch.randint(0, vocab_size, (b, s), device=device),
            "labels": torch.randint(0, vocab_size, (b, s), device=device),
            "positions": torch.arange(s, device=device).repeat(b, 1),
            "document_ids": torch.zeros(b, s, dtype=torch.int64, device=device),
        }
        if config.training.dataset == "preference":  # DPO: a pair per row
            batch.update(synthetic_pair_keys(b, s, device))
        batches.append(place_micro_batch(batch, pd, device))
    return batches


def reset_dtensor_rng() -> None:
    """Drop DTensor's process-wide RNG tracker: one made under a fake world or FakeTensorMode
    (the estimate) holds a fake state that breaks the next real run in the same process."""
    from torch.distributed.tensor import _random

    _random._rng_tracker = None


def tracked_step(
    config: JobConfig,
    world_size: int,
    device: torch.device,
    options: BuildOptions = TRAINING_BUILD,
    round_bytes: int = 1,
    tensor_mode: AbstractContextManager | None = None,
) -> StepResult:
    """Builds the run exactly as the trainer does (with the estimator's `options`: CUDA's
    optimizer, kernels and FakeInductor) and tracks one steady-state step.

    tensor_mode: entered once the meshes exist (FakeTensorMode for the estimate: DeviceMesh
    needs real rank tensors).
    """
    reset_dtensor_rng()
    layout = build_layout(config, world_size, device.type)
    pd = layout.parallel_dims
    with tensor_mode or nullcontext():
        run = build_run(config, layout, device, options)
        parts = run.model_parts
        create_optimizer_state(parts, run.optimizer)
        batches = synthetic_batches(
            config, pd, layout.model_args.vocab_size, run.grad_accum, device
        )
        tracker = MemoryTracker(round_bytes)
        tracker.track_model(parts, run.optimizer)
        if run.reference is not None:  # DPO's frozen copy: resident weights too
            tracker.track_frozen(run.reference)
        tracker.track_inputs(batches)  # the loader's micro-batches are all resident
        # From the second micro-batch on, each repeats the memory of the one before (gradients
        # exist, nothing is reduced) until the last, which syncs: tracing the first, the second
        # and the last finds the same peak as tracing all (16 on the 1-GPU MoE recipe).
        traced = batches if len(batches) <= 3 else [batches[0], batches[1], batches[-1]]
        with tracker:
            train_step(run, traced)
    n_params = sum(p.numel() for part in parts for p in part.parameters())
    return StepResult(tracker, pd, run.grad_accum, n_params)


@torch.no_grad()
def create_optimizer_state(parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on zero gradients of every part's trainable weights."""
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

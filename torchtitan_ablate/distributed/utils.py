"""Process-group setup and small collectives shared by the trainer and the parallel code."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_ablate.config import ConfigError


def pick_device(requested: str) -> torch.device:
    """auto -> this rank's CUDA device when there is one, else CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"training.device = {requested!r}: no CUDA device is visible "
                "(torch.cuda.is_available() is False); use 'auto' or 'cpu'"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"training.device = {requested!r}: LOCAL_RANK {local_rank} but only "
                f"{torch.cuda.device_count()} CUDA devices are visible; start at most that many "
                "processes per node (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 300) -> int:
    """Joins the torchrun process group (NCCL on CUDA, gloo on CPU); returns the world size.
    timeout_s: how long a rank waits in a collective (comm.init_timeout_seconds; the trainer
    shortens it after the first step, see set_timeout)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if dist.is_initialized():
        return dist.get_world_size()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size > 1 or "RANK" in os.environ:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        if backend == "gloo":
            # Every rank has finished connecting before any can fail its config checks and
            # close its sockets (a slower peer then saw "Connection closed by peer" in init).
            dist.barrier()
    else:
        # A one-rank group without torchrun: meshes (and single-GPU FSDP) work the same way.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return world_size


def current_world_size() -> int:
    """The default process group's size; 1 without one (a single process)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def set_timeout(timeout_s: float) -> None:
    """Every process group's collective timeout from now on (comm.train_timeout_seconds, set
    after the first step, as torchtitan does): a stalled or dead rank then fails the others
    within timeout_s instead of the long start-up timeout. The meshes' groups were made with
    the start-up one, so each group is set, not only the default."""
    if current_world_size() == 1:
        return
    # No rank may wait under the short timeout while another is still in a long first step.
    dist.barrier()
    timeout = timedelta(seconds=timeout_s)
    # pg_map lists every group this process belongs to (DeviceMesh makes them; no public list).
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def destroy_distributed() -> None:
    if dist.is_initialized():
        # gloo can abort a rank whose peer exits first: leave together. Not while an exception
        # propagates (called from a `finally`): an error only this rank saw (e.g. a bad line in
        # its data shard) leaves the peers inside another collective, and the barrier would
        # wait out the process-group timeout instead of letting torchrun stop them.
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class HostCopy:
    """A device tensor's values on their way to the host. On CUDA they are copied into pinned
    memory behind the work queued so far, so read() waits for that work only, not for what is
    queued after it: the host can read a step's values once the next step is queued and keep
    running ahead of the GPU (a read right away drains the GPU)."""

    def __init__(self, values: torch.Tensor) -> None:
        self._done = None
        self._host = values
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def read(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


class AnyRankLater:
    """Flags any rank may raise (a SIGTERM, rank 0's throughput verdict), agreed on by all ranks
    without a host wait each step: a call queues one all-reduce (max) of this step's flags and
    answers with the previous call's, a step late, unless `now` (a step whose values the host
    waits for anyway: logging, saving), which answers with this step's. A flag raised at a step
    that is not `now` must stay raised on its rank (a signal does), so a late answer loses
    nothing. Every rank calls it at every step with the same `now`. One process: the flags."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.alone = current_world_size() == 1
        self._queued: HostCopy | None = None

    def __call__(self, flags: list[bool], now: bool) -> list[bool]:
        if self.alone:
            return flags
        # From pinned memory: a copy from pageable memory to the GPU waits for the GPU.
        host = torch.tensor([float(f) for f in flags], pin_memory=self.device.type == "cuda")
        reduced = all_reduce_max(host.to(self.device, non_blocking=True), dist.group.WORLD)
        queued, previous = HostCopy(reduced), self._queued
        self._queued = None if now else queued
        answer = queued if now else previous
        return [False] * len(flags) if answer is None else [bool(x) for x in answer.read()]


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global L2 norm of all gradients (plain or DTensor on any meshes), clipped to max_norm.

    Parameters sharded on different meshes (dense vs expert-parallel) cannot be stacked into
    one DTensor norm, so each group's squared norm is made full and summed here. pp_group: the
    ranks holding the other pipeline stages, whose squared norms are added too (each stage
    holds other parameters), so every stage clips by the whole model's norm.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        assert pp_group is None, "every pipeline stage has gradients"
        return torch.zeros(())
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        by_mesh.setdefault(key, []).append(g)
    total_sq = None
    for group in by_mesh.values():
        sq = torch.nn.utils.get_total_norm(group, 2.0, foreach=True) ** 2
        if isinstance(sq, DTensor):
            sq = sq.full_tensor()
        total_sq = sq if total_sq is None else total_sq + sq
    total = all_reduce_sum(total_sq, pp_group).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Scale the local shards: a DTensor times a plain tensor is not allowed.
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(local, coef.to(local[0].device))
    return total

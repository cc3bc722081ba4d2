"""The estimator's world: a fake process group and fake tensors on a fake *cpu* device.

The fake process group (`FakeStore`, backend "fake") lets one process act as rank 0 of N: every
collective returns at once with correctly shaped outputs. FakeTensorMode makes every tensor
metadata only (shape, dtype, strides, storage size), so a 32B model costs no memory. A fake
*cuda* device aborts a CPU-only torch at its first autograd op, so the device is cpu
and `cuda_model.py` accounts for what CUDA does differently.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_ablate.config import JobConfig


def resolve_world_size(config: JobConfig) -> int:
    """memory_estimation.world_size, else NGPU * NNODES (as run_train.sh), else WORLD_SIZE,
    else 1."""
    n = config.memory_estimation.world_size
    if n != -1:  # the loader checked n >= 1 (config/rules.py)
        return n
    if "NGPU" in os.environ:
        return int(os.environ["NGPU"]) * int(os.environ.get("NNODES", 1))
    return int(os.environ.get("WORLD_SIZE", 1))


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank `rank` of a fake `world_size`-rank process group (use `fake_tensors()` once the
    meshes exist: DeviceMesh needs real rank tensors)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("memory estimation needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_dtensor_shardings()


def _forget_dtensor_shardings() -> None:
    """Empties DTensor's caches of sharding results (Python's and the C++ fast path's), which
    hold the meshes they were computed on. Meshes compare equal by layout, not by process
    group: the next fake world (another pipeline rank's: the estimator traces one per pipeline
    rank) would take this world's tp mesh from the cache, with group names its process group
    does not know."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


@contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Every tensor made inside is metadata only; real inputs (mesh tensors) are allowed.

    Weight values do not matter here (models/common/init.py draws none for fake tensors).
    DeviceMeshes made inside (FSDP concatenates the experts' meshes) compute their coordinates
    on real rank tensors: torch's DeviceMesh takes no tensor mode, so its constructor is
    wrapped for the duration (the one patch left, of torch itself, not of this package).
    """
    orig_mesh_init = DeviceMesh.__init__

    def mesh_init(self, *args, **kwargs) -> None:
        with unset_fake_temporarily():
            orig_mesh_init(self, *args, **kwargs)

    DeviceMesh.__init__ = mesh_init
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        DeviceMesh.__init__ = orig_mesh_init

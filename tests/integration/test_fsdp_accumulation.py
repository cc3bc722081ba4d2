"""FSDP work per optimizer step under gradient accumulation, training unchanged:
ZeRO-2 mode (fsdp_reshard_after_forward = "never") gathers the weights once per step, and on
one rank the gradients are reduced (copied into the fp32 shards) once per step."""

import functools
from dataclasses import replace

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training, build_trainer
from torchtitan_ablate.distributed.fsdp import OneRankReduceScatter
from torchtitan_ablate.models.qwen3 import qwen3_flavors

# Two steps: the counts per step and the equalities do not need more (CI time).
ARGS = [
    "--training.data_sharding",
    "rows",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "2",
]


def _train_counting_gathers(
    dump_folder: str, args: list[str], gather_once: bool, tied: bool = True
) -> dict:
    if not tied:  # untied tables are their own FSDP group (8B and larger flavors)
        debug = qwen3_flavors["debugmodel"]
        qwen3_flavors["debugmodel"] = replace(debug, tie_embeddings=False)
    trainer = build_trainer(dump_folder, args)
    if trainer.run.accumulation is not None:  # one fp32 CPU rank runs without FSDP
        trainer.run.accumulation.gather_once &= gather_once
    calls = []
    # FSDP2 looks its collective up at call time: all_gather_single on torch 2.13,
    # all_gather_into_tensor before.
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    reals = {n: getattr(dist, n) for n in names}

    def counting(real):
        def call(*a, **kw):
            calls.append(1)
            return real(*a, **kw)

        return call

    for n in names:
        setattr(dist, n, counting(reals[n]))
    try:
        losses = [r["loss"] for r in trainer.train()]
    finally:
        for n in names:
            setattr(dist, n, reals[n])
    return {"losses": losses, "all_gathers": len(calls)}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_zero2_gathers_once_per_step_with_accumulation(tmp_path, tied):
    ref = run_distributed(_train_counting_gathers, 1, str(tmp_path / "ref"), ARGS, True, tied)[0]
    zero2 = ARGS + ["--training.local_batch_size", "2"]  # 2 ranks x 2 rows x 2 micro-batches
    zero2 += ["--parallelism.fsdp_reshard_after_forward", "never"]
    run = functools.partial(run_distributed, _train_counting_gathers, 2)
    once = run(str(tmp_path / "once"), zero2, True, tied)[0]
    every = run(str(tmp_path / "every"), zero2, False, tied)[0]
    for a, b in zip(once["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (once["losses"], ref["losses"])
    assert once["losses"] == every["losses"]
    # Per step: one gather of every FSDP group instead of one per micro-batch (2).
    assert 0 < once["all_gathers"] and 2 * once["all_gathers"] == every["all_gathers"], (
        once,
        every,
    )


def _train_counting_reduces(
    dump_folder: str, args: list[str], sync_once: bool, own_comm: bool = True
) -> dict:
    trainer = build_trainer(dump_folder, args)
    assert trainer.run.accumulation.sync_grads_once  # on by itself on one rank
    trainer.run.accumulation.sync_grads_once = sync_once
    for module in trainer.model.modules():
        if isinstance(module, FSDPModule):
            (group,) = module._get_fsdp_state()._fsdp_param_groups
            assert isinstance(group._reduce_scatter_comm, OneRankReduceScatter)
            if not own_comm:
                module.set_custom_reduce_scatter(DefaultReduceScatter())
    real = _fsdp_param_group.foreach_reduce
    calls = []

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    _fsdp_param_group.foreach_reduce = counting
    try:
        losses = [r["loss"] for r in trainer.train()]
    finally:
        _fsdp_param_group.foreach_reduce = real
    sd = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    params = {k: v.clone() for k, v in sd.items()}
    return {"losses": losses, "params": params, "reduces": len(calls)}


def test_one_rank_reduces_gradients_once_per_step(tmp_path):
    # One rank in fp32 runs without FSDP; with bf16 compute FSDP gives the fp32 master weights.
    # 4 micro-batches of 2 rows per step; bf16 gradients accumulate in the fp32 reduce dtype.
    args = ARGS + ["--training.local_batch_size", "2", "--training.cpu_mixed_precision", "true"]
    once = run_distributed(_train_counting_reduces, 1, str(tmp_path / "once"), args, True)[0]
    every = run_distributed(_train_counting_reduces, 1, str(tmp_path / "every"), args, False)[0]
    # Same fp32 additions in the same order: bitwise the same training.
    assert_same_training(once, every, loss_rtol=0.0, atol=0.0)
    # The one-rank reduction (a copy into the training stream's pool) is FSDP's, bitwise.
    fsdp_comm = run_distributed(
        _train_counting_reduces, 1, str(tmp_path / "fsdp_comm"), args, True, False
    )[0]
    assert_same_training(once, fsdp_comm, loss_rtol=0.0, atol=0.0)
    assert 0 < once["reduces"] and 4 * once["reduces"] == every["reduces"], (once, every)

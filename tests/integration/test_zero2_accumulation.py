"""ZeRO-2 mode (fsdp_reshard_after_forward = "never") with gradient accumulation: the weights
are gathered once per optimizer step, not once per micro-batch, and training is unchanged."""

import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.integration.parallel_harness import build_trainer

ARGS = ["--training.data_sharding", "rows", "--training.global_batch_size", "8"]


def _train_counting_gathers(dump_folder: str, args: list[str], gather_once: bool) -> dict:
    trainer = build_trainer(dump_folder, args)
    trainer.model.fsdp_gather_once_per_step &= gather_once
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


def test_zero2_gathers_once_per_step_with_accumulation(tmp_path):
    ref = run_distributed(_train_counting_gathers, 1, str(tmp_path / "ref"), ARGS, True)[0]
    zero2 = ARGS + ["--training.local_batch_size", "2"]  # 2 ranks x 2 rows x 2 micro-batches
    zero2 += ["--parallelism.fsdp_reshard_after_forward", "never"]
    once = run_distributed(_train_counting_gathers, 2, str(tmp_path / "once"), zero2, True)[0]
    every = run_distributed(_train_counting_gathers, 2, str(tmp_path / "every"), zero2, False)[0]
    for a, b in zip(once["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (once["losses"], ref["losses"])
    assert once["losses"] == every["losses"]
    # Per step: one gather of every FSDP group instead of one per micro-batch (2).
    assert 0 < once["all_gathers"] and 2 * once["all_gathers"] == every["all_gathers"], (
        once,
        every,
    )

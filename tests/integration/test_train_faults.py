"""Faults a user meets on the debug model (docs/reliability.md): a run extended or resumed with
new settings, NaN/Inf during training, a checkpoint damaged on disk; one process and two gloo
ranks."""

import logging
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.checkpoint_damage import poison_saved_tensor
from tests.helpers.distributed import run_distributed
from torchtitan_ablate import train
from torchtitan_ablate.components.objective.finite import NonFiniteError
from torchtitan_ablate.components.optim.lr_scheduler import lr_factor
from torchtitan_ablate.config import load_config, run_main
from torchtitan_ablate.config.optim_config import LRScheduler
from torchtitan_ablate.distributed import utils as dist_utils

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]
BASE += ["--training.local_batch_size", "4", "--metrics.log_freq", "1"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "4"]
DIVERGE = ["--optimizer.lr", "1e6", "--training.max_norm", "0"]  # NaN within a few steps


def _argv(folder, *args: str) -> list[str]:
    return BASE + ["--job.dump_folder", str(folder), *args]


def run(folder, *args: str) -> list[dict]:
    return train.main(load_config(_argv(folder, *args)))


def _messages(caplog, pattern: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if re.search(pattern, r.getMessage())]


def test_extended_run_with_new_settings_follows_them_and_says_so(tmp_path, caplog, capsys):
    """8 steps, then 12 with a new lr, seq_len and batch: steps 9-12 run at the lr of the
    12-step schedule with the new lr (before: -6.67e-4 at step 9, and the old peak lr), config.toml
    and the run agree, and each change is one log line. Then a damaged step-12 is refused."""
    run(tmp_path / "split", "--training.steps", "8", *CKPT)
    new = ["--training.steps", "12", "--optimizer.lr", "1e-3"]
    resized = ["--training.seq_len", "128", "--training.local_batch_size", "2"]
    with caplog.at_level(logging.INFO):
        rest = run(tmp_path / "split", *new, *CKPT, *resized)
    assert [r["step"] for r in rest] == [9, 10, 11, 12]
    schedule = LRScheduler(warmup_steps=5)  # debug_model.toml's
    assert [r["lr"] for r in rest] == [1e-3 * lr_factor(s, 12, schedule) for s in range(9, 13)]
    assert min(r["lr"] for r in rest) >= 0
    written = load_config(["--job.config_file", str(tmp_path / "split" / "config.toml")])
    assert written.optimizer.lr == 1e-3
    changes = [re.sub(r" \(.*", "", m) for m in _messages(caplog, "changed on resume")]
    assert changes == [
        "lr schedule changed on resume: optimizer.lr 0.002 -> 0.001",
        "lr schedule changed on resume: training.steps 8 -> 12",
        "batch changed on resume: sequences per optimizer step 4 -> 2",
        "batch changed on resume: training.local_batch_size 4 -> 2",
        "batch changed on resume: training.seq_len 64 -> 128",
    ]

    # Damaged bytes in step-12: the run refuses it with one line instead of training on NaN.
    poison_saved_tensor(tmp_path / "split" / "checkpoint" / "step-12", "tok_embeddings.weight")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(train.main, _argv(tmp_path / "split", "--training.steps", "16", *CKPT))
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(
        r"config error: checkpoint \S+/step-12 holds NaN/Inf values \(e.g. "
        r"tok_embeddings.weight\b.*load_step to another complete step \[4, 8\]",
        line,
    )


def _saved_values_finite(step_dir) -> bool:
    """Every floating-point tensor of a saved checkpoint (model and optimizer) is finite."""
    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    pending, tensors = [torch.load(out, weights_only=False)], []
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += value.values()
        elif torch.is_tensor(value) and value.is_floating_point():
            tensors.append(value)
    assert len(tensors) > 100  # the model's and the optimizer's
    return all(torch.isfinite(t).all() for t in tensors)


# fused: the update is skipped on the device and the trainer reads the step's values once the
# next step is queued (except at steps it logs or saves); foreach: read before the update.
# fused-cuda: the default on GPUs, where the values come back through a pinned copy and an event.
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
IMPLEMENTATIONS = pytest.mark.parametrize(
    "impl", ["foreach", "fused", pytest.param("fused-cuda", marks=_CUDA)]
)


def _impl_args(impl: str) -> list[str]:
    if impl == "fused-cuda":
        return ["--optimizer.implementation", "fused", "--training.device", "cuda"]
    return ["--optimizer.implementation", impl, "--training.device", "cpu"]


@IMPLEMENTATIONS
def test_diverging_run_stops_with_one_line_and_exit_3(tmp_path, capsys, impl):
    """lr 1e6 without clipping trained NaN from step 3, exited 0 and saved NaN checkpoints that
    pruned the good ones; now it stops at the first non-finite value, saving nothing there."""
    args = ["--training.steps", "8", *DIVERGE, *_impl_args(impl)]
    args += ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2"]
    with pytest.raises(SystemExit) as e:
        run(tmp_path, *args)
    assert e.value.code == train.EXIT_NONFINITE == 3
    (line,) = capsys.readouterr().err.strip().splitlines()
    match = re.fullmatch(
        r"error: step (\d+): non-finite (loss|grad_norm) = (nan|inf).*: training stopped, "
        r"nothing saved at this step \(newest checkpoint: step-(\d+)\)",
        line,
    )
    assert match, line
    bad, newest = int(match.group(1)), int(match.group(4))
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoint").glob("step-*"))
    assert saved == list(range(max(1, bad - 2), bad)) and newest == bad - 1
    assert all(_saved_values_finite(tmp_path / "checkpoint" / f"step-{s}") for s in saved)


def _poison(trainer: train.Trainer, bad_steps: set[int], snapshots: dict) -> None:
    """The loss of `bad_steps` turns NaN (so do the gradients); the weights each step starts
    from are kept in `snapshots`."""
    real = trainer.run.loss_fn

    def loss_fn(model, batch):
        snapshots[trainer.step] = [p.detach().clone() for p in model.parameters()]
        loss = real(model, batch)
        return loss * float("nan") if trainer.step in bad_steps else loss

    trainer.run.loss_fn = loss_fn


@IMPLEMENTATIONS
def test_skip_nonfinite_steps_skips_updates_then_stops(tmp_path, caplog, impl):
    """skip_nonfinite_steps = 2: bad steps 2, 4 and 5 are skipped (the count restarts after a
    good step), the weights stay as they were; a third bad step in a row stops the run."""
    args = ["--training.steps", "6", "--training.skip_nonfinite_steps", "2"]
    args += [*_impl_args(impl), "--metrics.log_freq", "3"]
    try:
        trainer, snapshots = train.Trainer(load_config(_argv(tmp_path / "skip", *args))), {}
        _poison(trainer, {2, 4, 5}, snapshots)
        with caplog.at_level(logging.WARNING):
            records = trainer.train()
        assert len(_messages(caplog, r"non-finite.*optimizer step skipped")) == 3
        assert (
            "step 5: non-finite loss = nan, grad_norm = nan: optimizer step skipped (2 of"
            in caplog.text
        )
        for before, after in [(2, 3), (4, 6)]:  # steps 2, 4 and 5 left the weights unchanged
            assert all(torch.equal(a, b) for a, b in zip(snapshots[before], snapshots[after]))
        assert not all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4]))
        assert [r["step"] for r in records] == [1, 3, 6]
        assert torch.isfinite(torch.tensor(records[-1]["loss"]))

        trainer = train.Trainer(load_config(_argv(tmp_path / "stop", *args)))
        _poison(trainer, {3, 4, 5}, {})
        with pytest.raises(NonFiniteError, match=r"^step 5: non-finite loss = nan, .*\(3 steps"):
            trainer.train()
    finally:
        dist_utils.destroy_distributed()


def _two_ranks(folder: str, impl: str) -> list:
    """NaN in rank 1's loss only: both ranks stop (skip_nonfinite_steps 0), or both skip it and
    go on (1); then lr 1e6 through train.main exits 3 on both."""
    results = []
    for skip in ("0", "1"):
        args = ["--training.steps", "3", "--training.skip_nonfinite_steps", skip]
        args += _impl_args(impl)
        argv = _argv(f"{folder}/skip{skip}", *args)
        trainer = train.Trainer(load_config(argv))
        _poison(trainer, {2} if dist.get_rank() == 1 else set(), {})
        try:
            results.append([r["loss"] for r in trainer.train()])
        except NonFiniteError as e:
            results.append(str(e))
    try:
        run(f"{folder}/lr", "--training.steps", "6", *DIVERGE)
    except SystemExit as e:
        results.append(e.code)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_two_ranks_agree_on_nonfinite_steps(tmp_path, impl):
    results = run_distributed(_two_ranks, 2, str(tmp_path), impl)
    assert str(results[0]) == str(results[1])  # the same decisions and values on both ranks
    stopped, skipped, code = results[0]
    assert stopped.startswith("step 2: non-finite loss = nan"), stopped
    assert math.isnan(skipped[1]) and math.isfinite(skipped[2])  # went on after the skip
    assert code == 3


def test_values_read_a_step_late_count_the_same_tokens(tmp_path):
    """fused reads the steps between logs a step late: every record's tokens_seen is the same
    as with foreach, which reads each step before its update."""
    args = ["--training.steps", "6", "--metrics.log_freq", "4"]
    seen = {}
    for impl in ("foreach", "fused"):
        records = run(tmp_path / impl, *args, "--optimizer.implementation", impl)
        seen[impl] = [(r["step"], r["tokens_seen"]) for r in records]
    assert seen["fused"] == seen["foreach"] and [s for s, _ in seen["fused"]] == [1, 4, 6]

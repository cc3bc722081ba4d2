"""Non-finite values: a step's loss and grad norm, a state that is never saved, a checkpoint whose
tensors were damaged on disk (refused on load), on one process and on two gloo ranks."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard

from tests.helpers.checkpoint_damage import poison_saved_tensor
from tests.helpers.distributed import run_distributed
from torchtitan_ablate.components.checkpoint.manager import CheckpointManager
from torchtitan_ablate.components.objective.finite import NonFiniteError, StepValues
from torchtitan_ablate.config import ConfigError

NAN, INF = float("nan"), float("inf")


def _read(loss: float, norm: float, tokens: int = 5) -> tuple[str | None, int]:
    values = StepValues(torch.tensor(loss), torch.tensor(norm), torch.tensor(tokens))
    assert bool(values.nonfinite) == (values.read()[0] is not None)
    return values.read()


def test_step_values_name_the_value():
    assert _read(2.0, 1.0, 7) == (None, 7)
    assert _read(NAN, 1.0) == ("loss = nan", 5)
    assert _read(2.0, INF) == ("grad_norm = inf", 5)
    assert _read(NAN, NAN) == ("loss = nan, grad_norm = nan", 5)


def _build(fsdp: bool = False) -> tuple:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    if fsdp:
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _manager(folder, model, opt, sched, keep: int = 0, **kw) -> CheckpointManager:
    return CheckpointManager(
        folder=str(folder),
        enable=True,
        interval=1,
        keep_latest_k=keep,
        model_parts=[model],
        optimizers=[opt],
        lr_schedulers=[sched],
        dataloader=None,
        **kw,
    )


def _step(model, opt, sched) -> None:
    model(torch.ones(2, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_a_nonfinite_state_is_never_saved_nor_pruned_for(tmp_path, where):
    model, opt, sched = _build()
    mgr = _manager(tmp_path, model, opt, sched, keep=1)
    _step(model, opt, sched)
    assert mgr.save(1)
    _step(model, opt, sched)
    with torch.no_grad():
        target = model.weight if where == "model" else opt.state[model.weight]["exp_avg"]
        target[0, 0] = NAN
    name = "weight" if where == "model" else "optimizer.state.weight.exp_avg"
    with pytest.raises(NonFiniteError, match=rf"step 2: .*NaN/Inf \(e.g. {name}\); not saved"):
        mgr.save(2)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # keep_latest_k = 1 kept the good one


@pytest.mark.parametrize("key", ["weight", "optimizer.state.bias.exp_avg_sq"])
def test_a_checkpoint_with_damaged_values_is_refused(tmp_path, key):
    model, opt, sched = _build()
    mgr = _manager(tmp_path, model, opt, sched)
    for step in (1, 2):
        _step(model, opt, sched)
        mgr.save(step)
    poison_saved_tensor(tmp_path / "step-2", key)
    hint = r"delete .*step-2 or set checkpoint.load_step to another complete step \[1\]$"
    with pytest.raises(ConfigError, match=rf"checkpoint \S*step-2 holds NaN/Inf .*{key}.*{hint}"):
        mgr.load()
    assert mgr.load(1) == 1  # the good step still loads


def _on_two_ranks(folder: str) -> list[str]:
    """NaN on rank 1 only (a shard of the live weight, then a damaged file of rank 0): every
    rank must take the same decision, else the other would wait in the next collective."""
    model, opt, sched = _build(fsdp=True)
    mgr = _manager(folder, model, opt, sched)
    _step(model, opt, sched)
    mgr.save(1)
    errors = []
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.weight.to_local()[0, 0] = NAN
    try:
        mgr.save(2)
    except NonFiniteError as e:
        errors.append(str(e))
    if dist.get_rank() == 0:
        poison_saved_tensor(Path(folder) / "step-1", "weight")
    dist.barrier()
    try:
        mgr.load(1)
    except ConfigError as e:
        errors.append(str(e))
    return errors


@pytest.mark.slow
def test_two_ranks_agree_on_nonfinite_state(tmp_path):
    for rank, errors in enumerate(run_distributed(_on_two_ranks, 2, str(tmp_path))):
        assert len(errors) == 2, (rank, errors)
        save, load = errors
        assert "step 2: the model or optimizer state holds NaN/Inf" in save
        assert "step-1 holds NaN/Inf values" in load


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_initial_weights_with_nonfinite_values_are_refused(tmp_path):
    source, _, _ = _build()
    with torch.no_grad():
        source.bias[0] = INF
    dcp.save(source.state_dict(), checkpoint_id=str(tmp_path / "init"), no_dist=True)
    model, opt, sched = _build()
    mgr = _manager(tmp_path / "run", model, opt, sched, initial_load_path=str(tmp_path / "init"))
    with pytest.raises(ConfigError, match=r"initial_load_path = \S+init: holds NaN/Inf .*bias"):
        mgr.load()

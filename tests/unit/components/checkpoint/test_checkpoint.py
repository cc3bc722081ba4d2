"""CheckpointManager: exact resume, interval/pruning, crash safety, FSDP2 on 2 ranks and 2 -> 1."""

import logging
import os
import random
import shutil
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.helpers.distributed import run_distributed
from torchtitan_ablate.components.checkpoint import folder as checkpoint_folder
from torchtitan_ablate.components.checkpoint.manager import CheckpointManager
from torchtitan_ablate.components.checkpoint.state import TrainState
from torchtitan_ablate.config import ConfigError


class ToyLoader:
    """Endless random batches from a seeded generator; its state is the generator state."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield torch.randn(4, 8, generator=self.gen), torch.randn(4, 1, generator=self.gen)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])


def _build(seed: int, fsdp: bool = False) -> tuple:
    torch.manual_seed(seed)
    # Dropout draws from the global RNG, so resume is only exact if the RNG state is restored.
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 1))
    if fsdp:
        fully_shard(model[0])
        fully_shard(model[3])
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _manager(
    folder, model, opt, sched, loader, interval=1, keep=0, enable=True, **kw
) -> CheckpointManager:
    return CheckpointManager(
        folder=str(folder),
        enable=enable,
        interval=interval,
        keep_latest_k=keep,
        model_parts=[model],
        optimizers=[opt],
        lr_schedulers=[sched],
        dataloader=loader,
        **kw,
    )


def _train(model, opt, sched, batches, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x, y = next(batches)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _loader(data: TensorDataset) -> StatefulDataLoader:
    # Its own generator: without one, iter() draws a seed from the global RNG, which after a
    # resume happens once the RNG is restored, shifting the dropout masks.
    return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator())


def test_exact_resume_single_process(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))

    model, opt, sched = _build(0)
    loader = _loader(data)
    state = TrainState()
    mgr = _manager(tmp_path, model, opt, sched, loader, states={"train_state": state})
    assert mgr.load() == 0
    batches = iter(loader)
    _train(model, opt, sched, batches, 3)
    state.step, state.tokens_seen = 3, 12
    assert mgr.save(3)
    expected = _train(model, opt, sched, batches, 3)
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(999)  # a different RNG stream and init: load must restore both
    random.seed(999)
    model, opt, sched = _build(1)
    loader = _loader(data)
    state = TrainState()
    mgr = _manager(tmp_path, model, opt, sched, loader, states={"train_state": state})
    assert mgr.load() == 3
    assert (state.step, state.tokens_seen) == (3, 12)
    assert sched.last_epoch == 3
    assert _train(model, opt, sched, iter(loader), 3) == expected
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected_params[k]), k


def test_interval_force_and_pruning(tmp_path):
    model, opt, sched = _build(0)
    mgr = _manager(tmp_path, model, opt, sched, None, interval=2, keep=2)
    saved = [step for step in range(1, 8) if mgr.save(step)]
    assert saved == [2, 4, 6]
    assert mgr.save(7, force=True)
    assert mgr.save(7, force=True)  # re-saving a step replaces it
    assert sorted(os.listdir(tmp_path)) == ["step-6", "step-7"]
    assert mgr.load() == 7
    assert mgr.load(6) == 6  # sets step 7 aside (test_older_load_step_sets_newer_steps_aside)
    with pytest.raises(ConfigError, match=r"step-5 does not exist; complete steps .*: \[6\]"):
        mgr.load(5)

    keep_all = _manager(tmp_path / "all", model, opt, sched, None, interval=1, keep=0)
    for step in range(1, 4):
        keep_all.save(step)
    assert keep_all.complete_steps() == [1, 2, 3]

    off = _manager(tmp_path / "off", model, opt, sched, None, enable=False)
    assert not off.save(10, force=True) and off.load() == 0
    assert not (tmp_path / "off").exists()


def test_crash_leftovers_are_ignored(tmp_path):
    model, opt, sched = _build(0)
    _manager(tmp_path, model, opt, sched, ToyLoader(0)).save(3)
    # A save that died before its rename, a delete that died, a step dir without .metadata.
    for name in ["step-5.tmp", "step-4.deleting", "step-7"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
    mgr = _manager(tmp_path, model, opt, sched, ToyLoader(0))
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-7"]  # stale dirs removed at start
    assert mgr.complete_steps() == [3]
    assert mgr.load() == 3
    with pytest.raises(ValueError, match=r"step-7 is not a complete DCP checkpoint.*distcp"):
        mgr.load(7)
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"cannot read .*step-9/\.metadata"):
        mgr.load()


def test_damaged_or_mismatched_checkpoint_is_a_config_error(tmp_path):
    model, opt, sched = _build(0)
    mgr = _manager(tmp_path, model, opt, sched, ToyLoader(0))
    mgr.save(1)
    mgr.save(2)
    (data,) = (tmp_path / "step-2").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:100])  # cut short: DCP fails with EOFError
    delete_hint = r"delete .*step-2 or set checkpoint.load_step to another complete step \[1\]$"
    with pytest.raises(ConfigError, match=rf"step-2: EOFError: .*{delete_hint}"):
        mgr.load()
    data.unlink()  # missing: DCP fails with FileNotFoundError
    with pytest.raises(ConfigError, match=rf"step-2: FileNotFoundError: .*{delete_hint}"):
        mgr.load()
    assert mgr.complete_steps() == [1, 2]  # no silent fallback, nothing removed
    (tmp_path / "step-2" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=rf"cannot read .*step-2/\.metadata: .*{delete_hint}"):
        mgr.load()

    # Another model in the same folder: neither a smaller nor a bigger one loads.
    for hidden in ([8], [16, 16]):
        sizes = [8, *hidden, 1]
        other = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])
        opt = torch.optim.AdamW(other.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        with pytest.raises(ConfigError, match=r"step-1 .*resume with the config that wrote it"):
            _manager(tmp_path, other, opt, sched, ToyLoader(0)).load(1)


def test_older_load_step_sets_newer_steps_aside(tmp_path, caplog):
    model, opt, sched = _build(0)
    mgr = _manager(tmp_path, model, opt, sched, None, keep=0)
    for step in range(1, 5):
        mgr.save(step)

    mgr = _manager(tmp_path, model, opt, sched, None, keep=1, load_step=2, training_steps=2)
    with caplog.at_level(logging.WARNING):
        assert mgr.load() == 2
    assert "checkpoint step 2 >= training.steps = 2: nothing to train" in caplog.text
    assert mgr.complete_steps() == [1, 2, 3, 4]  # nothing trains, so nothing is set aside

    mgr = _manager(tmp_path, model, opt, sched, None, keep=1, load_step=2, training_steps=4)
    assert mgr.load() == 2
    (aside,) = (tmp_path / "abandoned").iterdir()
    assert sorted(os.listdir(aside)) == ["step-3", "step-4"]
    assert mgr.complete_steps() == [1, 2]
    assert mgr.save(3)  # keep 1: the new step-3 survives, only it is left
    assert mgr.complete_steps() == [3]
    assert CheckpointManager.complete_steps(_manager(aside, model, opt, sched, None)) == [3, 4]
    assert _manager(tmp_path, model, opt, sched, None).load() == 3

    # Without a load (no set-aside), pruning still spares the step just saved.
    mgr = _manager(tmp_path / "p", model, opt, sched, None, keep=0)
    for step in (1, 3, 4):
        mgr.save(step)
    _manager(tmp_path / "p", model, opt, sched, None, keep=2).save(2)
    assert sorted(os.listdir(tmp_path / "p")) == ["step-2", "step-4"]


def test_resave_that_dies_midway_keeps_the_step(tmp_path, monkeypatch):
    model, opt, sched = _build(0)
    mgr = _manager(tmp_path, model, opt, sched, ToyLoader(0))
    mgr.save(3)
    rename = os.rename

    def crash_before_new_is_in_place(src, dst):
        if str(src).endswith("step-3.tmp"):
            raise OSError("simulated crash")
        rename(src, dst)

    monkeypatch.setattr(checkpoint_folder.os, "rename", crash_before_new_is_in_place)
    with pytest.raises(OSError, match="simulated crash"):
        mgr.save(3, force=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step-3.replaced", "step-3.tmp"]
    mgr = _manager(tmp_path, model, opt, sched, ToyLoader(0))
    assert sorted(os.listdir(tmp_path)) == ["step-3"]  # restored; the unfinished save removed
    assert mgr.load() == 3

    # Died after the swap, before the old copy was removed: the new step stays.
    shutil.copytree(tmp_path / "step-3", tmp_path / "step-3.replaced")
    (tmp_path / "step-3" / "new").touch()
    _manager(tmp_path, model, opt, sched, ToyLoader(0))
    assert sorted(os.listdir(tmp_path)) == ["step-3"]
    assert (tmp_path / "step-3" / "new").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_initial_load_path_loads_model_only(tmp_path):
    source, _, _ = _build(0)
    dcp.save(get_model_state_dict(source), checkpoint_id=str(tmp_path / "init"), no_dist=True)
    model, opt, sched = _build(1)
    mgr = _manager(
        tmp_path / "run", model, opt, sched, None, initial_load_path=str(tmp_path / "init")
    )
    assert mgr.load() == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, source.state_dict()[k]), k
    assert not opt.state  # the optimizer starts fresh

    bad = _manager(tmp_path / "run2", model, opt, sched, None, initial_load_path=str(tmp_path))
    with pytest.raises(ValueError, match="not a complete DCP checkpoint"):
        bad.load()


def _full_states(model, opt) -> tuple[dict, dict]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    flat = StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
    )
    optim = get_optimizer_state_dict(model, opt, options=flat)
    # Plain (non-DTensor) entries such as AdamW's `step` alias the live tensors: copy them.
    optim = {k: v.clone() if torch.is_tensor(v) else v for k, v in optim.items()}
    return get_model_state_dict(model, options=options), optim


def _fsdp_save_and_resume(folder: str) -> tuple:
    rank = dist.get_rank()
    model, opt, sched = _build(0, fsdp=True)
    loader = ToyLoader(100 + rank)  # each rank reads different data
    mgr = _manager(folder, model, opt, sched, loader)
    batches = iter(loader)
    _train(model, opt, sched, batches, 3)
    mgr.save(3)
    full = _full_states(model, opt)  # rank 0 only (the others get empty dicts)
    expected = _train(model, opt, sched, batches, 3)

    torch.manual_seed(1234 + rank)
    model, opt, sched = _build(1, fsdp=True)
    loader = ToyLoader(0)
    mgr = _manager(folder, model, opt, sched, loader)
    assert mgr.load() == 3
    got = _train(model, opt, sched, iter(loader), 3)
    mgr.save(6)
    assert mgr.load(3) == 3  # rank 0 sets step 6 aside while the others wait
    assert mgr.complete_steps() == [3]
    return expected, got, full


@pytest.mark.slow
def test_fsdp2_two_ranks_resume_and_reshard_to_one(tmp_path):
    results = run_distributed(_fsdp_save_and_resume, 2, str(tmp_path))
    for expected, got, _ in results:
        assert got == expected
    full_model, full_optim = results[0][2]

    model, opt, sched = _build(1)  # one process, no process group, plain module
    mgr = _manager(tmp_path, model, opt, sched, ToyLoader(0))
    assert mgr.load(3) == 3
    for k, v in get_model_state_dict(model).items():
        assert torch.equal(v, full_model[k]), k
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    optim = get_optimizer_state_dict(model, opt, options=flat)
    assert optim.keys() == full_optim.keys()
    for k, v in optim.items():
        assert torch.equal(v, full_optim[k]) if torch.is_tensor(v) else v == full_optim[k], k

"""CheckpointManager: exact resume, interval/pruning, crash safety, FSDP2 on 2 ranks and 2 -> 1."""

import os
import random
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

from tests.dist_utils import run_distributed
from torchtitan_ablate.components.checkpoint import CheckpointManager, TrainState


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
    assert mgr.load(6) == 6
    with pytest.raises(ValueError, match="step-5 does not exist"):
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
    return expected, _train(model, opt, sched, iter(loader), 3), full


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

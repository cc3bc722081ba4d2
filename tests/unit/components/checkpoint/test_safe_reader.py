"""components/checkpoint/safe_reader.py: what the project saves reads back through the
allow-lists unchanged, and a checkpoint made to run code (in .metadata, in a non-tensor entry,
in a pickled state) is refused with one line before the code runs. The refusals are also the
guard against a torch release that reads either part some other way (see the module doc)."""

import pickle
import random
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.untrusted_checkpoint import CodePayload, plant_in_metadata
from torchtitan_ablate.components.checkpoint.safe_reader import ForeignObject, SafeReader, loads
from torchtitan_ablate.components.checkpoint.state import (
    Pickled,
    Record,
    RNGState,
    SchedulerList,
    TrainState,
    dcp_load,
    dcp_save,
    saved_keys,
)


def _states() -> dict:
    """One of each kind of entry a training checkpoint holds; the values depend on the RNG."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    settings = {"optimizer.lr": random.random(), "optimizer.no_decay": ["norm"], "n": None}
    return {
        **model.state_dict(),  # tensors
        "step": random.randint(1, 99),  # a non-tensor entry: an int
        "group": {"betas": (0.9, random.random()), "foreach": None, "fused": False},
        "train_state": TrainState(step=random.randint(1, 99), tokens_seen=7),
        "rng.rank0": Pickled(RNGState()),  # a pickle holding a tensor and Python's tuple state
        "settings": Pickled(Record(settings)),
        "lr_scheduler": Pickled(SchedulerList([sched])),
    }


def test_what_the_project_saves_reads_back(tmp_path):
    torch.manual_seed(0)
    random.seed(0)
    saved = _states()
    dcp_save(saved, str(tmp_path / "ckpt"))
    rng_after_save = (torch.get_rng_state(), random.getstate())
    torch.manual_seed(1)
    random.seed(1)
    loaded = _states()
    loaded["settings"].obj.value = None
    assert saved_keys(str(tmp_path / "ckpt")) >= {"step", "group.betas", "settings.pickle"}
    dcp_load(loaded, str(tmp_path / "ckpt"))
    for key in ("weight", "bias", "step", "group"):
        assert str(loaded[key]) == str(saved[key]), key
    assert vars(loaded["train_state"]) == vars(saved["train_state"])
    assert loaded["settings"].obj.loaded == saved["settings"].obj.value
    assert torch.equal(torch.get_rng_state(), rng_after_save[0])  # RNGState loaded in place
    assert random.getstate() == rng_after_save[1]


def test_code_in_the_metadata_is_refused_before_it_runs(tmp_path):
    dcp_save({"w": torch.ones(2)}, str(tmp_path / "ckpt"))
    marker = tmp_path / "ran"
    plant_in_metadata(tmp_path / "ckpt", marker)
    where = f"{tmp_path / 'ckpt' / '.metadata'} holds builtins.exec, which a checkpoint may not"
    with pytest.raises(ForeignObject, match=f"^{where}"):
        saved_keys(str(tmp_path / "ckpt"))
    with pytest.raises(ForeignObject, match=f"^cannot load checkpoint \\S+: {where}"):
        dcp_load({"w": torch.zeros(2)}, str(tmp_path / "ckpt"))
    # What DCP makes of the refusal differs by release (2.11: "metadata is None", 2.13: an
    # AssertionError quoting it); the reader keeps it for the caller.
    reader = SafeReader(tmp_path / "ckpt")
    with pytest.raises(dcp.CheckpointException):
        dcp.load({"w": torch.zeros(2)}, storage_reader=reader, no_dist=True)
    assert isinstance(reader.refused, ForeignObject) and str(reader.refused).startswith(where)
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["step", "pickled state"])
def test_code_in_an_entry_is_refused_before_it_runs(tmp_path, entry):
    """A non-tensor entry is a torch.save'd object that DCP's planner loads with
    weights_only=False; a pickled state is pickle.loads'd by Pickled."""
    marker = tmp_path / "ran"
    payload = CodePayload(marker)
    if entry == "step":
        state, what = {"w": torch.ones(2), "step": payload}, "entry 'step'"
    else:
        state = {"w": torch.ones(2), "settings": {"pickle": pickle.dumps(payload)}}
        what = "a pickled state"
    dcp_save(state, str(tmp_path / "ckpt"))
    target = {"w": torch.zeros(2), "step": 0, "settings": Pickled(Record(None))}
    target = {k: v for k, v in target.items() if k.split(".")[0] in state}
    with pytest.raises(ForeignObject) as e:
        dcp_load(target, str(tmp_path / "ckpt"))
    # torch's weights-only unpickler names a builtin without its module
    assert re.fullmatch(
        f"cannot load checkpoint {re.escape(str(tmp_path / 'ckpt'))}: {what} holds "
        r"(builtins\.)?exec, which a checkpoint may not hold \(loading it could run code\): load "
        "DCP checkpoints only from sources you trust, and third-party weights as Hugging Face "
        r'safetensors \(checkpoint.initial_load_format = "hf"\)',
        str(e.value),
    ), str(e.value)
    assert not marker.exists()
    # Without the allow-list the same load runs the code: the test plants what it says.
    if entry == "step":
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    else:
        pickle.loads(state["settings"]["pickle"])
    assert marker.exists()


def test_loads_takes_plain_data_and_tensors_only():
    value = {"a": (1, 2.5, None), "b": {3, 4}, "t": torch.arange(3), "s": b"x"}
    back = loads(pickle.dumps(value), "here")
    assert back["a"] == value["a"] and back["b"] == value["b"] and back["s"] == b"x"
    assert torch.equal(back["t"], value["t"])
    with pytest.raises(ForeignObject, match=r"^here holds torch\.nn\.modules\.linear\.Linear,"):
        loads(pickle.dumps(torch.nn.Linear(1, 1)), "here")

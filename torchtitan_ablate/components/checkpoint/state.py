"""What one checkpoint holds and how DCP writes and reads it.

The Stateful wrappers give each part of the training state its DCP form (FQN-keyed model and
optimizer, so both reshard; opaque pickles for states whose shape may change). Loading sorts
DCP's failures into `Damaged` (files missing or unreadable) and `Mismatch` (a checkpoint of
another model or config), so that checkpoint.py can tell the user what to do about each.
Every pickle of a checkpoint (DCP's index, its non-tensor entries, the pickled states) is read
through safe_reader.py's allow-lists: a file naming anything else is refused (ForeignObject).

A checkpoint holds state, the config holds settings: on load the optimizer keeps this run's
hyperparameters (lr, betas, eps, weight_decay, ...) and the LR schedule only its step, so a
resumed run steps as its own config says (run_settings.py lists what changed).
"""

import os
import pickle
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_ablate.components.checkpoint.folder import METADATA
from torchtitan_ablate.components.checkpoint.safe_reader import ForeignObject, SafeReader, loads
from torchtitan_ablate.components.optim.lr_scheduler import set_schedule_step
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.library_warnings import ignored

# Optimizer state keyed by parameter FQN, so it reshards like the model does.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState(Stateful):
    """Counters the trainer may register as an extra state (`states={"train_state": ...}`)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ModelWrapper(Stateful):
    """All model parts as one FQN-keyed state dict (DTensor shards under FSDP2, else tensors)."""

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            own = {k: state_dict[k] for k in get_model_state_dict(part)}
            set_model_state_dict(part, own)


class OptimizerWrapper(Stateful):
    """The optimizers' state as one flat state dict keyed by parameter FQN: one optimizer per
    model part, or one over all of them (a rank's several pipeline stages share one)."""

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        if len(optimizers) == 1 and len(model_parts) > 1:
            # torch maps an optimizer's parameters to FQNs through one module.
            model_parts = [merge_parts(model_parts)]
        if len(model_parts) != len(optimizers):
            raise ValueError(
                f"need one optimizer per model part or one for all, got {len(optimizers)} "
                f"optimizers for {len(model_parts)} model parts"
            )
        self.pairs = list(zip(model_parts, optimizers))

    def state_dict(self) -> dict[str, Any]:
        return {
            k: v
            for model, optim in self.pairs
            for k, v in get_optimizer_state_dict(model, optim, options=_OPTIM_OPTIONS).items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the moments and step counts; the param groups' hyperparameters stay this
        run's (the checkpoint's would silently override a changed config)."""
        for model, optim in self.pairs:
            own = get_optimizer_state_dict(model, optim, options=_OPTIM_OPTIONS).keys()
            settings = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
            set_optimizer_state_dict(
                model, optim, {k: state_dict[k] for k in own}, options=_OPTIM_OPTIONS
            )
            for group, kept in zip(optim.param_groups, settings, strict=True):
                group.update(kept)


def merge_parts(parts: list[nn.Module]) -> nn.Module:
    """One module holding the parts' modules under their own names (pipeline stages keep the
    whole model's names: stage 0's `layers.0`, stage 3's `layers.6`, `norm`, `output`). A name
    that several parts hold is a container (`layers`), merged anew: no part is changed."""
    # The merged modules' own parameters would be lost (the Qwen3 parts and `layers` hold none).
    assert not any(p._parameters for p in parts), "model parts with parameters of their own"
    merged = nn.Module()
    children: dict[str, list[nn.Module]] = {}
    for part in parts:
        for name, child in part.named_children():
            children.setdefault(name, []).append(child)
    for name, same in children.items():
        merged.add_module(name, same[0] if len(same) == 1 else merge_parts(same))
    return merged


class RNGState:
    """This process's RNG streams: Python, torch CPU and (when present) the current CUDA device."""

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


class Pickled(Stateful):
    """Stores an object's state as one opaque blob.

    DCP would otherwise flatten the nested dict and, on load, demand exactly the keys of the live
    object's current state, whose shape can differ (a fresh loader vs one mid-epoch, a newer torch).
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"pickle": pickle.dumps(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(loads(state_dict["pickle"], "a pickled state"))


class Record:
    """A plain value saved as it is (through Pickled); what a load read is kept in `loaded`,
    beside this run's `value`, for the caller to compare."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.loaded: Any = None

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


def read_record(path: str) -> Any:
    """The settings record (run_settings.py) of the checkpoint at `path`, read alone (every
    rank calls it when a process group is up); Damaged or Mismatch when it cannot be read."""
    record = Record(None)
    # Without collectives: rank 0's export at the last step reads it while the others wait.
    dcp_load({"settings": Pickled(record)}, path, alone=True)
    return record.loaded


class SchedulerList:
    """The LR schedulers (one per model part) as one state: only their step is saved, the LR
    is recomputed from this run's schedule (peak LR and factors); a count mismatch is the
    user's."""

    def __init__(self, schedulers: list[LambdaLR]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> list[dict[str, Any]]:
        return [{"last_epoch": s.last_epoch} for s in self.schedulers]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.schedulers):
            raise ConfigError(
                f"checkpoint has {len(states)} LR schedulers, run has {len(self.schedulers)}"
            )
        # A checkpoint may hold LambdaLR's whole state; its step is all that is read.
        for sched, state in zip(self.schedulers, states):
            set_schedule_step(sched, state["last_epoch"])


class Damaged(ConfigError):
    """A checkpoint's files are missing, cut short or unreadable."""


class Mismatch(ConfigError):
    """A checkpoint that does not fit this run's model or states."""


def dcp_save(state: dict[str, Any], path: str) -> None:
    """dcp.save into `path`, with or without a process group."""
    with ignored():  # DCP's warning of no process group: one process is meant here
        dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def dcp_load(state: dict[str, Any], path: str, alone: bool = False) -> None:
    """dcp.load from `path` in place (alone: this process only, no collective); any failure
    is raised as Damaged or Mismatch."""
    with ignored():
        reader = SafeReader(path)
        try:
            dcp.load(state, storage_reader=reader, no_dist=alone or not dist.is_initialized())
        # DCP gathers every rank's failure into a CheckpointException, a BaseException, raised
        # on every rank alike.
        except (Exception, dcp.CheckpointException) as e:
            cause, where = _cause(e)
            # Not damage: a file made to run code (refused by this rank's reader, another
            # rank's, or Pickled after the read).
            refused = reader.refused or (cause if isinstance(cause, ForeignObject) else None)
            if refused is not None:
                raise ForeignObject(f"cannot load checkpoint {path}: {refused}") from None
            if isinstance(cause, ConfigError):  # a state's own line: which key, how to fix it
                raise ConfigError(f"checkpoint {path}: {cause}") from e
            # DCP's planner reports shape and key mismatches as ValueError / KeyError; anything
            # else (a missing file, a cut-off pickle or zip) is damage to the files.
            kind = Mismatch if isinstance(cause, (ValueError, KeyError)) else Damaged
            raise kind(f"cannot load checkpoint {path}: {_one_line(cause)}{where}") from e


def _cause(e: BaseException) -> tuple[BaseException, str]:
    """The first rank's underlying error and where (DCP's own message is a multi-rank trace).
    An interrupt that DCP wrapped is raised as it is: it is not the checkpoint's fault."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, (cause, _) = min(e.failures.items())
        if not isinstance(cause, Exception):
            raise cause
        return cause, f" (rank {rank})"
    return e, ""


def _one_line(e: BaseException) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 300 else f"{text[:300]}..."


def saved_keys(path: str) -> set[str]:
    """The flattened keys a complete DCP checkpoint holds; ConfigError if it is not one."""
    if not os.path.isfile(os.path.join(path, METADATA)):
        found = sorted(os.listdir(path))[:10] if os.path.isdir(path) else "nothing"
        raise Damaged(f"{path} is not a complete DCP checkpoint: no {METADATA} (found {found})")
    try:
        metadata = SafeReader(path).read_metadata()
    except ForeignObject:
        raise
    except Exception as e:
        raise Damaged(f"cannot read {path}/{METADATA}: {_one_line(e)}") from e
    return set(metadata.state_dict_metadata)


def check_keys(path: str, state: dict[str, Any], keys: set[str]) -> None:
    """Names what a checkpoint lacks up front (DCP would stop at the first missing key)."""
    missing = [k for k in state if k not in keys and not any(s.startswith(f"{k}.") for s in keys)]
    if missing:
        raise Mismatch(
            f"checkpoint {path} lacks {len(missing)} entries this run needs (saved by another "
            f"model or config?): {sorted(missing)[:8]}"
        )


def unread_model_entries(state: dict[str, Any], keys: set[str]) -> list[str]:
    """Checkpoint entries no rank of this run loads: those of a bigger model. Data loader, RNG
    and settings entries are left out (other ranks' are expected to stay unread); with pipeline
    parallel each rank loads its own part's entries, so an entry counts only if every rank
    lacks it."""
    extra = {
        k
        for k in keys
        if not k.startswith(("dataloader.", "rng.", "settings."))
        and not any(".".join(k.split(".")[:i]) in state for i in range(1, k.count(".") + 2))
    }
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[set[str]] = [set()] * dist.get_world_size()
        dist.all_gather_object(every, extra)
        extra = set.intersection(*every)
    return sorted(extra)

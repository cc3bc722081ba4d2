"""Checkpointing with torch.distributed.checkpoint (DCP): periodic save, pruning, exact resume.

Layout: `<folder>/step-<N>/` is one DCP checkpoint. Its state dict holds
  - the model's FQNs at the top level (so a model-only checkpoint is just the model state dict),
  - `optimizer` (flattened, FQN-keyed: reshards across N -> M ranks),
  - `lr_scheduler` (its step only), `step`, `settings` (what made the checkpoint: model, data,
    optimizer keys, run_settings.py; read first on resume) and each extra state the trainer
    registers (same on every rank),
  - `dataloader.rank<r>` and `rng.rank<r>` (one per rank: each rank's data and RNG differ).
    A checkpoint of another world size restores neither, except the data loader when its state
    is the same on every rank (rows sharding): then every rank loads `dataloader.rank0`.
A save writes `step-<N>.tmp/` and rank 0 renames it to `step-<N>/` only after DCP has written
`.metadata` on every rank, so a crash mid-save never leaves a `step-<N>` that resume would pick.
Only `step-<N>` directories holding `.metadata` count as checkpoints; a model-only `step-0` (the
seed checkpoint, seed_checkpoint.py) resumes as weights alone. folder.py holds
the on-disk layout and its crash-safe changes (re-saves, crash recovery at start, pruning, setting
aside the steps newer than an explicit `load_step`); state.py gives each part of the
state its DCP form (the Stateful wrappers) and wraps DCP's save and load, sorting load failures
into damage and mismatch.
No state holding a NaN or Inf is saved (NonFiniteError), and none is resumed from: a checkpoint
whose tensors load non-finite (damaged bytes) is refused like one whose files are unreadable.
"""

import logging
import os
import re
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_ablate.components.checkpoint import folder as ckpt_dir
from torchtitan_ablate.components.checkpoint.hf import load_hf_weights
from torchtitan_ablate.components.checkpoint.run_settings import (
    checked_record,
    data_changed,
    describe_changes,
)
from torchtitan_ablate.components.checkpoint.state import (
    Damaged,
    Mismatch,
    ModelWrapper,
    OptimizerWrapper,
    Pickled,
    Record,
    RNGState,
    SchedulerList,
    check_keys,
    dcp_load,
    dcp_save,
    saved_keys,
    unread_model_entries,
)
from torchtitan_ablate.components.objective.finite import NonFiniteError, nonfinite_entries
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.distributed.utils import current_world_size

logger = logging.getLogger(__name__)

_RESERVED = ("optimizer", "lr_scheduler", "step", "settings", "dataloader", "rng")


class CheckpointManager:
    """Saves every `interval` steps into `<folder>/step-<N>/`, keeps the step just saved and the
    newest `keep_latest_k - 1` others (<= 0 keeps all), and resumes from the newest complete step
    (or `load_step`). A user's mistake (a missing, damaged or mismatched checkpoint) raises
    ConfigError naming the step folder and what to do.

    `enable=False` turns off saving and resuming from `folder`; `initial_load_path` (a model-only
    or full DCP checkpoint, or with `initial_load_format="hf"` an HF folder) still seeds the
    model weights when there is nothing to resume from.
    `states` are extra Stateful objects saved under their names, e.g. {"train_state": TrainState()}.
    Every rank must call the constructor, `save` and `load` (they hold collectives).
    """

    def __init__(
        self,
        *,
        folder: str,
        enable: bool,
        interval: int,
        keep_latest_k: int,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        lr_schedulers: list,
        dataloader: Any | None,
        initial_load_path: str | None = None,
        initial_load_format: str = "dcp",
        load_step: int = -1,
        states: dict[str, Stateful] | None = None,
        dataloader_state_shared: bool = False,
        training_steps: int | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """dataloader_state_shared: the loader's state is the same on every rank at a step
        boundary (rows sharding, <= 1 worker), so it resumes from rank 0's at any world size.
        training_steps: the run's last step, to warn when the resumed step leaves nothing to do.
        settings: this run's record (run_settings.run_settings), saved in each checkpoint; a
        resume refuses another model, LoRA or tokenizer, restarts the data when it is other
        data and logs every other difference, one line each."""
        if enable and interval <= 0:
            raise ValueError(f"checkpoint interval must be > 0, got {interval}")
        self.states = dict(states or {})
        for name in self.states:
            if name.split(".")[0] in _RESERVED:
                raise ValueError(f"checkpoint state name {name!r} is reserved ({_RESERVED})")
        self.folder, self.enable, self.interval = folder, enable, interval
        self.keep_latest_k = keep_latest_k
        if initial_load_format not in ("dcp", "hf"):
            raise ValueError(f"checkpoint.initial_load_format = {initial_load_format!r}: dcp or hf")
        self.initial_load_path, self.initial_load_format = initial_load_path, initial_load_format
        self.load_step, self.training_steps = load_step, training_steps
        self.model = ModelWrapper(model_parts)
        self.optimizer = OptimizerWrapper(model_parts, optimizers)
        self.lr_schedulers = Pickled(SchedulerList(lr_schedulers))
        self.settings = None if settings is None else Record(settings)  # .value: this run's
        self.dataloader, self.dataloader_state_shared = dataloader, dataloader_state_shared
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = current_world_size()
        if enable:
            if self.rank == 0:
                os.makedirs(folder, exist_ok=True)
                ckpt_dir.recover(folder)
            _barrier()  # no rank lists or writes the folder while rank 0 tidies it

    def due(self, step: int) -> bool:
        """Whether save(step) saves without force."""
        return self.enable and step % self.interval == 0

    def save(self, step: int, force: bool = False) -> bool:
        """Saves at `step` when enabled and (`step % interval == 0` or `force`); True if saved."""
        if not (self.due(step) or (self.enable and force)):
            return False
        final = self.step_dir(step)
        tmp = f"{final}.tmp"
        count, names = self._nonfinite()
        if count:
            # Raised on every rank alike (the count is summed over ranks), before any file is
            # written: pruning never removes a good checkpoint for this one.
            raise NonFiniteError(
                f"step {step}: the model or optimizer state holds NaN/Inf ({_names(names)}); "
                f"not saved to {final}, the older checkpoints are kept"
            )
        if self.rank == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp)
        _barrier()  # no rank may write into tmp before rank 0 has cleared it
        t0 = time.perf_counter()
        state = {**self.model.state_dict(), **self._states(step, for_load=False)}
        dcp_save(state, tmp)
        _barrier()  # every rank's files and the .metadata are in tmp
        if self.rank == 0:
            ckpt_dir.replace(tmp, final)
            ckpt_dir.prune(self.folder, self.keep_latest_k, keep=step)
        _barrier()  # nobody proceeds (or loads) before the rename
        logger.info(f"saved checkpoint {final} in {time.perf_counter() - t0:.1f}s")
        return True

    def load(self, step: int = -1) -> int:
        """Restores everything from `step` (-1: `load_step`, whose -1 means the newest complete
        step); returns the step loaded, or 0 when there was nothing to resume.

        Resuming from a step older than the newest complete one moves the newer steps to
        `<folder>/abandoned/<time>/`: this run writes its own steps of those numbers, and neither
        pruning nor a later resume may take the abandoned run's for them."""
        step = step if step >= 0 else self.load_step
        if self.enable:
            steps = self.complete_steps()
            if step >= 0 or steps:
                explicit = step >= 0
                step = step if explicit else steps[-1]
                path = self.step_dir(step)
                if not os.path.isdir(path):
                    raise ConfigError(
                        f"checkpoint.load_step = {step}: {path} does not exist; complete steps "
                        f"in {self.folder}: {steps or 'none'} (-1 resumes from the newest)"
                    )
                if self.initial_load_path:
                    logger.info(f"resuming from {path}: initial_load_path is not used")
                try:
                    if step == 0 and "step" not in saved_keys(path):
                        # create_seed_checkpoint's step 0: model weights only (as torchtitan).
                        self._load_weights(path, "dcp")
                        logger.info(f"loaded the seed checkpoint {path} (model weights)")
                    else:
                        self._load_full(path, step)
                except Damaged as e:
                    others = [s for s in steps if s != step]
                    raise ConfigError(
                        f"{e}; delete {path}"
                        + (
                            f" or set checkpoint.load_step to another complete step {others}"
                            if others
                            else " to start afresh (there is no other complete step)"
                        )
                    ) from e
                except Mismatch as e:
                    raise ConfigError(
                        f"{e}; resume with the config that wrote it, or use another job.dump_folder"
                    ) from e
                if self.training_steps is not None and step >= self.training_steps:
                    # Nothing is trained or saved, so the newer steps stay where they are.
                    logger.warning(
                        f"checkpoint step {step} >= training.steps = {self.training_steps}: "
                        "nothing to train; raise training.steps to continue"
                    )
                elif explicit and steps and steps[-1] > step:
                    self._set_aside_newer(step)
                return step
        elif step >= 0:
            logger.warning(f"load_step={step} has no effect: checkpointing is disabled")
        if self.initial_load_path:
            try:
                self._load_initial()
            except ConfigError as e:
                raise ConfigError(
                    f"checkpoint.initial_load_path = {self.initial_load_path}: {e}"
                ) from e
        return 0

    def complete_steps(self) -> list[int]:
        """Steps in `folder` whose save finished (a `step-<N>` directory holding `.metadata`)."""
        return ckpt_dir.complete_steps(self.folder)

    def step_dir(self, step: int) -> str:
        return ckpt_dir.step_dir(self.folder, step)

    def _set_aside_newer(self, step: int) -> None:
        _barrier()  # every rank is done reading the folder before it changes
        if self.rank == 0:
            moved, dest = ckpt_dir.set_aside_newer(self.folder, step)
            if moved:
                logger.warning(
                    f"load_step {step} is older than the newest checkpoint: moved the abandoned "
                    f"run's steps {moved} to {dest} (never pruned; delete them when not needed)"
                )
        _barrier()

    def _load_initial(self) -> None:
        self._load_weights(self.initial_load_path, self.initial_load_format)
        logger.info(
            f"loaded model weights from {self.initial_load_path} ({self.initial_load_format})"
        )

    def _load_weights(self, path: str, load_format: str) -> None:
        """The model's weights (nothing else) from an HF folder or a model-only or full DCP
        checkpoint."""
        model_sd = self.model.state_dict()
        if load_format == "hf":
            load_hf_weights(model_sd, path)
        else:
            keys = saved_keys(path)
            # LoRA adapters absent from a base checkpoint keep their initial values.
            to_load = {k: v for k, v in model_sd.items() if k in keys or ".lora_" not in k}
            check_keys(path, to_load, keys)
            dcp_load(to_load, path)
        count, names = nonfinite_entries(model_sd)
        if count:
            raise Damaged(f"holds NaN/Inf values ({_names(names)}): damaged or diverged")
        self.model.load_state_dict(model_sd)

    def _states(self, step: int, for_load: bool, saved_ranks: set[int] | None = None) -> dict:
        """Everything but the model. On load, per-rank entries are only asked for when the
        checkpoint was written by the same number of ranks (else they would not mean the same)."""
        states = {"optimizer": self.optimizer, "lr_scheduler": self.lr_schedulers, "step": step}
        states.update(self.states)
        if self.settings is not None and not for_load:  # a load reads it first: checked_record
            states["settings"] = Pickled(self.settings)
        if not for_load or saved_ranks == set(range(self.world_size)):
            states[f"rng.rank{self.rank}"] = Pickled(RNGState())
            if self.dataloader is not None:
                states[f"dataloader.rank{self.rank}"] = Pickled(self.dataloader)
        elif self.dataloader is not None and self.dataloader_state_shared:
            states["dataloader.rank0"] = Pickled(self.dataloader)
        return states

    def _nonfinite(self) -> tuple[int, list[str]]:
        """NaN/Inf in the live model and optimizer state (counted over all ranks), named as
        in a checkpoint."""
        optim = {f"optimizer.{k}": v for k, v in self.optimizer.state_dict().items()}
        return nonfinite_entries({**self.model.state_dict(), **optim})

    def _load_full(self, path: str, step: int) -> None:
        keys = saved_keys(path)
        current = None if self.settings is None else self.settings.value
        saved = None if current is None else checked_record(path, keys, current)  # refuses
        saved_ranks = {int(m.group(1)) for k in keys if (m := re.match(r"rng\.rank(\d+)\.", k))}
        state = {**self.model.state_dict(), **self._states(step, True, saved_ranks)}
        if "dataloader.rank0" in state and f"rng.rank{self.rank}" not in state:
            logger.warning(
                f"checkpoint {path} was saved by {len(saved_ranks)} ranks, this run has "
                f"{self.world_size}: the data continues from rank 0's loader state (rows "
                "sharding); RNG states are not restored"
            )
        elif f"rng.rank{self.rank}" not in state:
            logger.warning(
                f"checkpoint {path} was saved by {len(saved_ranks)} ranks, this run has "
                f"{self.world_size}: data loader and RNG states are not restored (inexact resume)"
            )
        elif self.dataloader is not None and f"dataloader.rank{self.rank}.pickle" not in keys:
            state.pop(f"dataloader.rank{self.rank}", None)
            logger.warning(f"checkpoint {path} has no data loader state: data restarts")
        restart = saved is not None and data_changed(saved, current)
        for name in (f"dataloader.rank{self.rank}", "dataloader.rank0") if restart else ():
            state.pop(name, None)  # its position points into data that is gone
        for name in self.states:  # a state the checkpoint lacks (train_state) keeps its defaults
            if not any(k == name or k.startswith(f"{name}.") for k in keys):
                state.pop(name)
                logger.warning(f"checkpoint {path} has no {name}: it starts from its defaults")
        check_keys(path, state, keys)
        # A smaller model would load silently from a bigger one's checkpoint: refuse it. Other
        # ranks' (or a skipped) data loader and RNG entries are expected to be left unread.
        extra = unread_model_entries(state, keys)
        if extra:
            raise Mismatch(
                f"checkpoint {path} holds {len(extra)} model entries this run lacks (saved by "
                f"another model or config?): {sorted(extra)[:8]}"
            )
        dcp_load(state, path)
        if state["step"] != step:
            raise ConfigError(
                f"checkpoint {path} holds step {state['step']}, not {step} (was it renamed?)"
            )
        self.model.load_state_dict(state)
        count, names = self._nonfinite()
        if count:
            raise Damaged(
                f"checkpoint {path} holds NaN/Inf values ({_names(names)}): its files are "
                "damaged or it was saved from a diverged run"
            )
        logger.info(f"loaded checkpoint {path}")
        if saved is not None:
            restored = any(k.startswith("dataloader.") for k in state)
            gone = restart or (self.dataloader is not None and not restored)
            for line in describe_changes(saved, current, step, gone):
                logger.info(line)


def _names(names: list[str]) -> str:
    """Where the NaN/Inf values are, for the one-line message (names known on this rank)."""
    return f"e.g. {', '.join(names)}" if names else "on another rank"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

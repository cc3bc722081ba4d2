"""Train one config on N gloo ranks (or one process) on the *same global batch* and return the
per-step losses and the final full parameters, for layout-equivalence tests."""

import dataclasses
import itertools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtitan_ablate import build, train
from torchtitan_ablate.components import data as data_mod
from torchtitan_ablate.config import load_config

BASE = [
    "--job.config_file",
    "train_configs/debug_model.toml",
    "--training.seq_len",
    "64",
    "--training.steps",
    "5",
    "--metrics.log_freq",
    "1",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "1",
]
GLOBAL_BATCH = 8


class _GlobalBatchSlice:
    """Reads the global batch stream (as one rank would) and yields this dp rank's rows, so
    every layout sees the union of exactly the same rows as the one-process reference.

    Its position is the trainer's step (skip that many global batches at iter()), so a
    checkpoint taken at one world size resumes the same stream at another."""

    def __init__(self, loader, dp_rank: int, dp: int) -> None:
        self.loader, self.dp_rank, self.dp = loader, dp_rank, dp
        self.batches_done = lambda: 0

    def __iter__(self):
        skip = self.batches_done()
        for i, batch in enumerate(self.loader):
            if i < skip:
                continue
            rows = GLOBAL_BATCH // self.dp
            yield {k: v[self.dp_rank * rows : (self.dp_rank + 1) * rows] for k, v in batch.items()}

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def _build_global_slicing_loader(data, tokenizer, dp_rank, dp, **kw):
    whole = dataclasses.replace(data, local_batch_size=GLOBAL_BATCH)
    loader = data_mod.build_dataloader(whole, tokenizer, 0, 1, **kw)
    return _GlobalBatchSlice(loader, dp_rank, dp)


def build_trainer(dump_folder: str, args: list[str]) -> train.Trainer:
    """This rank's trainer for BASE + args (with the real data loader unless patched)."""
    return train.Trainer(load_config(BASE + ["--job.dump_folder", dump_folder] + args))


def train_layout(dump_folder: str, args: list[str]) -> dict:
    """Runs on every rank; returns losses, gradient norms (before clipping), the logged expert
    loads and aux losses (MoE; None for dense), the validation losses (None where it did not
    validate) and (rank 0) the full fp32 parameters."""
    build.build_dataloader = _build_global_slicing_loader
    trainer = build_trainer(dump_folder, args)
    trainer.dataloader.batches_done = lambda: trainer.step * trainer.grad_accum
    records = trainer.train()
    return {
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "load": [r.get("expert_load_max_over_mean") for r in records],
        "aux": [r.get("moe_aux_loss") for r in records],
        "validation": [r.get("validation_loss") for r in records],
        "params": full_params(trainer),
    }


def full_params(trainer: train.Trainer) -> dict | None:
    """The whole model's full fp32 parameters on rank 0 (None elsewhere): with pipeline
    parallel, every stage's, gathered from the ranks that hold them."""
    pp = trainer.parallel_dims.pp
    options = StateDictOptions(full_state_dict=True, cpu_offload=pp == 1)
    sd = {}
    for part in trainer.run.model_parts:
        sd.update(
            {k: v.cpu().clone() for k, v in get_model_state_dict(part, options=options).items()}
        )
    if pp > 1:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(sd, gathered, dst=0)
        sd = {k: v for part in gathered or [] for k, v in part.items()}
    return sd if dist.get_rank() == 0 else None


def assert_same_training(
    got: dict,
    ref: dict,
    loss_rtol: float = 1e-5,
    atol: float = 1e-4,
    grad_norm_rtol: float | None = None,
) -> None:
    """Per-step losses within loss_rtol (relative), final parameters within atol; with
    grad_norm_rtol, also the per-step gradient norms (relative). AdamW is nearly blind to the
    scale of a step's gradient, so a wrong clipping norm hardly shows in the weights. Where
    `got` validated, its validation losses too (loss_rtol), at the reference's steps."""
    for step, (a, b) in enumerate(itertools.zip_longest(got["losses"], ref["losses"]), 1):
        assert a is not None and b is not None, "different number of steps"
        assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: loss {a} vs reference {b}"
    if any(v is not None for v in got.get("validation", [])):
        for step, (a, b) in enumerate(zip(got["validation"], ref["validation"], strict=True), 1):
            assert (a is None) == (b is None), f"step {step}: validated {a} vs reference {b}"
            if a is not None:
                assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: validation {a} vs {b}"
    if grad_norm_rtol is not None:
        for step, (a, b) in enumerate(zip(got["grad_norms"], ref["grad_norms"], strict=True), 1):
            assert abs(a - b) <= grad_norm_rtol * b, f"step {step}: grad norm {a} vs {b}"
    assert got["params"].keys() == ref["params"].keys()
    for k in ref["params"]:
        torch.testing.assert_close(
            got["params"][k], ref["params"][k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}"
        )

"""Measuring tool only: the trainer with train_step's non-finite guard (its mid-step host sync)
off, to price that sync. NOSYNC_END=1: no host read at all in the step (the trained-token count
taken as the batch's ids); else the token count is read after the optimizer step is queued."""

import os

import torchtitan_ablate.train as t
from torchtitan_ablate.step import train_step


class NoGuard(t.Trainer):
    def train_step(self, batches):
        out = train_step(self.run, batches, guard_nonfinite=False)
        if os.environ.get("NOSYNC_END") == "1":
            out["tokens"] = sum(b["input_ids"].numel() for b in batches)
        else:
            out["tokens"] = int(out["tokens"])
        return out


t.Trainer = NoGuard
t.run_main(t.main)

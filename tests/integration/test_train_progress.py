"""Progress and trackers end to end on CPU: tokens_seen exact across a resume, the console line's
step k/N, ETA and n/a fields, and Weights & Biases (a fake module: no network)."""

import json
import logging
import re
import sys
import types

from tests.helpers.distributed import run_distributed
from tests.helpers.training import run, run_cli
from torchtitan_ablate import train
from torchtitan_ablate.config import load_config


def test_tokens_seen_exact_across_resume_and_console_progress(tmp_path, caplog):
    # Padding packing: the count must leave the pad tokens out, so it differs from B x S x step.
    common = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]
    common += ["--training.packing", "padding"]
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        full = run(tmp_path / "full", *common)
    seen = [r["tokens_seen"] for r in full]
    assert all(0 < a < b for a, b in zip(seen, seen[1:])) and seen[-1] < 6 * 4 * 64
    first = run(tmp_path / "split", *common, "--training.exit_at_step", "3")
    rest = run(tmp_path / "split", *common)
    assert [r["tokens_seen"] for r in first + rest] == seen
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in rows] == seen
    assert all(isinstance(r["time"], float) and r["time"] > 1e9 for r in rows)
    lines = [x.getMessage() for x in caplog.records if x.getMessage().startswith("step")]
    assert lines[2].startswith("step     3/6") and "mfu n/a" in lines[2] and "mem n/a" in lines[2]
    assert " elapsed 0:00:" in lines[2] and " eta 0:00:" in lines[2]


class FakeRun:
    def __init__(self, **kwargs) -> None:
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, values))

    def finish(self) -> None:
        self.finished = True


def test_wandb_logs_the_jsonl_fields_and_the_resolved_config(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(FakeRun(**kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run(
        tmp_path,
        "--training.steps", "3",
        "--metrics.enable_wandb", "true",
        "--metrics.wandb_mode", "offline",
        "--metrics.wandb_tags", "a,b",
        "--metrics.wandb_group", "abl",
    )  # fmt: skip
    (w,) = runs
    assert w.kwargs["mode"] == "offline" and w.kwargs["tags"] == ["a", "b"]
    assert w.kwargs["group"] == "abl" and w.kwargs["name"] == tmp_path.name
    assert w.kwargs["config"]["training"]["steps"] == 3  # the resolved config, as a dict
    assert w.finished and [s for s, _ in w.logged] == [1, 2, 3]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    # Every field but the nulls (mfu, memory: n/a on CPU), which W&B is not given as numbers.
    assert set(w.logged[-1][1]) == {k for k, v in row.items() if v is not None} - {"step"}
    assert row["mfu"] is None and row["memory_max_active_gib"] is None
    assert w.logged[-1][1]["tokens_seen"] == row["tokens_seen"] == 3 * 4 * 64  # greedy: no pad


def test_epochs_set_the_steps_and_the_run_ends_with_a_summary(tmp_path, caplog):
    """training.epochs 0.01 of the debug corpus (43,232 tokens) at 4 x 64 tokens per step is
    ceil(433 / 256) = 2 steps, said in one line; warmup_ratio 0.5 of them is 1 step. The last
    line sums the run up; config.toml records the derived steps and loads again."""
    args = ["--training.epochs", "0.01", "--lr_scheduler.warmup_ratio", "0.5"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "10"]
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        records = run(tmp_path, *args)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["lr"] == 2e-3 / 2  # the recipe's peak, at step 1 of a 1-step warmup
    lines = [x.getMessage() for x in caplog.records]
    derived = [x for x in lines if x.startswith("training.epochs")]
    assert len(derived) == 1 and re.fullmatch(
        r"training.epochs = 0.01: 43,232 tokens per pass over the data \(counted in [\d.]+ s\), "
        r"256 per step -> training.steps = 2",
        derived[0],
    )
    summary = lines[-1].replace(str(tmp_path), "RUN")
    assert re.fullmatch(
        rf"run ended: final loss {records[-1]['loss']:.4f} \(step 2\), 512 tokens trained, "
        r"wall time 0:00:\d\d; outputs in RUN: metrics RUN/metrics.jsonl, last checkpoint "
        r"RUN/checkpoint/step-2",
        summary,
    )
    toml = (tmp_path / "config.toml").read_text()
    assert "# steps = 2  (from training.epochs)" in toml
    assert "# warmup_steps = 1  (from lr_scheduler.warmup_ratio)" in toml
    again = load_config(["--job.config_file", str(tmp_path / "config.toml")])
    assert again.training.epochs == 0.01 and again.lr_scheduler.warmup_ratio == 0.5


def test_exit_at_step_past_the_derived_steps_is_one_line(tmp_path):
    args = ["--training.epochs", "0.01", "--checkpoint.enable", "--training.exit_at_step", "3"]
    code, lines = run_cli(tmp_path, *args)
    assert code == 2 and lines == [
        "config error: training.exit_at_step = 3 is after the last step (training.epochs = 0.01 "
        "gives training.steps = 2): use a step in 1..2, or -1"
    ]


def _epoch_run(dump: str) -> list[int]:
    """One rank of a 2-rank run in epochs: the steps it trained."""
    args = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", dump]
    args += ["--training.seq_len", "16", "--training.local_batch_size", "2"]
    args += ["--training.epochs", "0.002", "--metrics.log_freq", "1"]
    return [r["step"] for r in train.Trainer(load_config(args)).train()]


def test_every_rank_derives_the_same_steps(tmp_path):
    """Two data-parallel ranks read their own documents, yet count the same pass over all of
    them at the doubled global batch: ceil(0.002 x 43,232 = 87 / (2 x 2 x 16)) = 2 steps on
    both (a rank that stopped elsewhere would leave the other waiting in a collective)."""
    assert run_distributed(_epoch_run, 2, str(tmp_path)) == [[1, 2], [1, 2]]

"""Progress and trackers end to end on CPU: tokens_seen exact across a resume, the console line's
step k/N, ETA and n/a fields, and Weights & Biases (a fake module: no network)."""

import json
import logging
import sys
import types

from tests.helpers.training import run


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
    assert set(w.logged[-1][1]) == set(row) - {"step"}
    assert w.logged[-1][1]["tokens_seen"] == row["tokens_seen"] == 3 * 4 * 64  # greedy: no pad

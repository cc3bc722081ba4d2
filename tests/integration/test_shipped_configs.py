"""Every shipped recipe runs at debug size on CPU gloo ranks: same TOML, with the flavor, sequence
and step count shrunk, and its parallel degrees kept (EP capped at 2). Compile and float8 have
their own tests (CPU inductor and float8 kernels are slow), so they are switched off here."""

from pathlib import Path

import pytest
import tomllib

from tests.helpers.distributed import run_distributed
from torchtitan_ablate import train
from torchtitan_ablate.config import load_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))


def _train(args: list[str]) -> list[dict]:
    return train.main(load_config(args))


def debug_overrides(path: Path) -> tuple[int, list[str]]:
    toml = tomllib.loads(path.read_text())
    par = toml.get("parallelism", {})
    moe = "A" in toml["model"]["flavor"] or "moe" in toml["model"]["flavor"]
    args = ["--model.flavor", "debugmodel_moe" if moe else "debugmodel"]
    args += ["--model.n_layers", "-1", "--model.num_experts", "-1"]
    args += ["--training.seq_len", "64", "--training.local_batch_size", "2"]
    args += ["--training.steps", "3", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1"]
    args += ["--compile.enable", "false", "--float8.enable", "false"]
    args += ["--checkpoint.enable", "false"]
    # The harness's ranks are daemonic processes, which may not start loader workers; loader
    # workers under torchrun are tested in test_launcher.py.
    args += ["--training.num_workers", "0"]
    ep = min(par.get("expert_parallel_degree", 1), 2)
    args += ["--parallelism.expert_parallel_degree", str(ep)]
    world = par.get("data_parallel_replicate_degree", 1) * par.get("context_parallel_degree", 1)
    world = max(world, ep, 2 if ep > 1 or par else 1)
    return world, args


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipe_runs_at_debug_size(tmp_path, path):
    world, args = debug_overrides(path)
    args = ["--job.config_file", str(path), "--job.dump_folder", str(tmp_path)] + args
    records = run_distributed(_train, world, args)[0]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] for r in records)  # finite (not NaN)
    assert records[-1]["loss"] < records[0]["loss"]

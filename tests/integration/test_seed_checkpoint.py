"""checkpoint.create_seed_checkpoint: one process writes step-0 (model only) and exits; a 2-rank
FSDP run starts from exactly those weights through checkpoint.initial_load_path, and by resuming
in the seed's dump folder; 2 processes, parallelism degrees or a second weight source are
refused with one line. The ablation plan names each variant's initial weights."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tests.helpers.distributed import captured_log, run_distributed
from torchtitan_ablate import train
from torchtitan_ablate.ablate.plan import plan_layout
from torchtitan_ablate.components.checkpoint.offline_weights import read_dcp_model
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.models.qwen3 import qwen3_flavors
from torchtitan_ablate.seed_checkpoint import create_seed_checkpoint

pytestmark = pytest.mark.slow  # multi-process

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "debugmodel_moe"]
BASE += ["--training.seq_len", "64", "--training.local_batch_size", "2"]
SEED = ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _two_ranks(seed_dump: str, seed_path: str, tmp: str) -> dict | None:
    """FSDP 2 from the seed checkpoint, two ways; and the seed refused on 2 processes."""
    out = {}
    # Another seed, so a weight that was not loaded would show.
    runs = {
        "initial_load_path": (f"{tmp}/run", ["--checkpoint.initial_load_path", seed_path]),
        "resume": (seed_dump, ["--checkpoint.enable"]),
    }
    for name, (dump, args) in runs.items():
        config = load_config(BASE + ["--job.dump_folder", dump, "--training.seed", "99"] + args)
        trainer = train.Trainer(config)
        out[f"{name}_fresh"] = _full_weights(trainer.model)
        out[f"{name}_step"] = trainer.checkpointer.load()
        out[name] = _full_weights(trainer.model)
    try:
        create_seed_checkpoint(load_config(BASE + SEED + ["--job.dump_folder", f"{tmp}/no"]))
    except ConfigError as e:
        out["refused"] = str(e)
    return out if dist.get_rank() == 0 else None


def test_seed_checkpoint_is_written_once_and_loaded_by_every_layout(tmp_path) -> None:
    seed_dump = str(tmp_path / "seed")
    with captured_log() as lines:
        assert train.main(load_config(BASE + SEED + ["--job.dump_folder", seed_dump])) == []
    seed_path = os.path.join(seed_dump, "checkpoint", "step-0")
    said = [x for x in lines if "seed checkpoint" in x]
    assert said == [
        f"seed checkpoint (seed 42, cpu) written to {seed_path}; start any layout from it with "
        f"--checkpoint.initial_load_path {seed_path}"
    ]
    assert sorted(os.listdir(os.path.dirname(seed_path))) == ["step-0"]
    seed = read_dcp_model(
        tmp_path / "seed" / "checkpoint" / "step-0", qwen3_flavors["debugmodel_moe"]
    )

    got = run_distributed(_two_ranks, 2, seed_dump, seed_path, str(tmp_path), timeout_s=300)[0]
    for way in ("initial_load_path", "resume"):
        assert got[f"{way}_step"] == 0
        assert not torch.equal(
            got[f"{way}_fresh"]["layers.0.attention.wq.weight"],
            seed["layers.0.attention.wq.weight"],
        )
        for k, v in seed.items():
            assert torch.equal(got[way][k], v), f"{way}: {k}"
    assert got["refused"].startswith("checkpoint.create_seed_checkpoint = true: this run has 2 ")


@pytest.mark.parametrize(
    "args,says",
    [
        (["--checkpoint.enable=false"], "needs checkpoint.enable = true"),
        (["--parallelism.data_parallel_shard_degree", "2"], "data_parallel_shard_degree = 2; "),
        (["--parallelism.expert_parallel_degree", "2"], "expert_parallel_degree = 2; "),
        (["--checkpoint.initial_load_path", "x"], "initial_load_path = 'x' is set"),
        (["--memory_estimation.enable"], "run them separately"),
    ],
)
def test_seed_checkpoint_refusals(args: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match="checkpoint.create_seed_checkpoint = true") as err:
        load_config(BASE + SEED + args)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_ablation_plan_names_the_initial_weights() -> None:
    assert plan_layout(load_config(BASE), 1)["initial_weights"] == "seed"
    path = "outputs/seed/checkpoint/step-0"
    config = load_config(BASE + ["--checkpoint.initial_load_path", path])
    assert plan_layout(config, 1)["initial_weights"] == path

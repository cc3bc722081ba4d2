"""checkpoint.last_save_in_hf: the checkpoint of the run's last step is also written in Hugging
Face format into step-<N>/hf: the files scripts/convert_checkpoint.py --to hf writes (the LoRA
case: tests/unit/scripts/test_peft_export.py), which load through the project's HF path with the
checkpoint's weights."""

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.training import run
from torchtitan_ablate.components.checkpoint.hf import load_hf_weights
from torchtitan_ablate.components.checkpoint.offline_weights import (
    read_dcp_model,
    recorded_args,
    recorded_settings,
)
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.models.registry import state_dict_adapter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_checkpoint  # noqa: E402


def test_the_last_step_is_also_saved_as_the_convert_script_exports_it(tmp_path):
    run(tmp_path / "run", "--training.steps", "2", "--checkpoint.enable",
        "--checkpoint.interval", "1", "--checkpoint.last_save_in_hf", "true",
        "--checkpoint.export_dtype", "bfloat16")  # fmt: skip
    folder = tmp_path / "run/checkpoint"
    assert not (folder / "step-1/hf").exists()  # only the last step
    hf, converted = folder / "step-2/hf", tmp_path / "converted"
    convert_checkpoint.main(
        ["--to", "hf", str(folder / "step-2"), str(converted), "--dtype", "bfloat16"]
    )
    names = sorted(p.name for p in hf.iterdir())
    assert names == ["config.json", "model.safetensors"]
    assert all((hf / n).read_bytes() == (converted / n).read_bytes() for n in names)
    args = recorded_args(recorded_settings(folder / "step-2"))
    shapes = state_dict_adapter(args).native_shapes()
    loaded = {k: torch.full(s, float("nan")) for k, s in shapes.items()}
    load_hf_weights(loaded, hf)
    for key, saved in read_dcp_model(folder / "step-2", args).items():
        torch.testing.assert_close(loaded[key], saved.to(torch.bfloat16).float(), msg=key)


def test_last_save_in_hf_needs_checkpointing():
    argv = ["--job.config_file", "train_configs/debug_model.toml"]
    with pytest.raises(ConfigError, match="last_save_in_hf = true needs checkpoint.enable"):
        load_config([*argv, "--checkpoint.last_save_in_hf", "true"])

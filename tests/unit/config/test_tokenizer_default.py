"""Starting from HF weights (checkpoint.initial_load_format = "hf") without a tokenizer named by
the recipe or the command line: the HF folder's own tokenizer, logged by name; a folder without
one is refused in one line, since the default (the debug tokenizer) would train garbage."""

import logging
import shutil
from pathlib import Path

import pytest

from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.config.job_config import Model
from torchtitan_ablate.config.precheck import check_before_torch

ROOT = Path(__file__).resolve().parents[3]
SFT = str(ROOT / "train_configs" / "qwen3_0.6b_sft.toml")
DEBUG_TOKENIZER = Model.tokenizer_path


def _hf_folder(tmp_path: Path, tokenizer: str | None = "tokenizer.json") -> Path:
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if tokenizer is not None:
        shutil.copy(ROOT / DEBUG_TOKENIZER, folder / tokenizer)
    return folder


def _hf(folder: Path) -> list[str]:
    return ["--checkpoint.initial_load_format", "hf", "--checkpoint.initial_load_path", str(folder)]


@pytest.mark.parametrize("tokenizer", ["tokenizer.json", "tokenizer.model", "qwen.tiktoken"])
def test_the_hf_folders_tokenizer_is_the_default(tmp_path, tokenizer):
    folder = _hf_folder(tmp_path, tokenizer)
    assert load_config(_hf(folder)).model.tokenizer_path == str(folder)


def test_the_shipped_fine_tuning_recipe_takes_the_folders_tokenizer(tmp_path):
    # The documented command without --model.tokenizer_path.
    folder = _hf_folder(tmp_path)
    config = load_config(["--job.config_file", SFT, "--checkpoint.initial_load_path", str(folder)])
    assert config.model.tokenizer_path == str(folder)
    assert load_config(["--job.config_file", SFT]).model.tokenizer_path == DEBUG_TOKENIZER


def test_a_tokenizer_named_by_the_command_line_or_the_recipe_is_kept(tmp_path):
    folder = _hf_folder(tmp_path)
    named = ["--model.tokenizer_path", DEBUG_TOKENIZER]  # the default's value, but named
    assert load_config(_hf(folder) + named).model.tokenizer_path == DEBUG_TOKENIZER
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[model]\ntokenizer_path = "{ROOT / DEBUG_TOKENIZER}"\n')
    config = load_config(["--job.config_file", str(recipe), *_hf(folder)])
    assert config.model.tokenizer_path == str(ROOT / DEBUG_TOKENIZER)


def test_dcp_weights_keep_the_default(tmp_path):
    folder = _hf_folder(tmp_path)
    config = load_config(["--checkpoint.initial_load_path", str(folder)])  # format dcp
    assert config.model.tokenizer_path == DEBUG_TOKENIZER


def test_an_hf_folder_without_a_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    folder = _hf_folder(tmp_path, tokenizer=None)
    with pytest.raises(ConfigError, match="model.tokenizer_path"):
        load_config(_hf(folder))
    with pytest.raises(SystemExit) as e:
        check_before_torch(_hf(folder), "prog")
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(folder) in lines[0] and "--model.tokenizer_path" in lines[0]
    # Named explicitly, the debug tokenizer is the user's choice.
    load_config(_hf(folder) + ["--model.tokenizer_path", DEBUG_TOKENIZER])


def test_the_run_logs_the_tokenizer_it_uses(tmp_path, caplog):
    import torch

    from torchtitan_ablate.build import build_data, check_layout

    folder = _hf_folder(tmp_path, "qwen.tiktoken")
    config = load_config(_hf(folder))
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        build_data(config, check_layout(config, 1), torch.device("cpu"))
    assert f"tokenizer: {folder}" in caplog.text

"""Relative input paths in a TOML are found from the TOML's folder or a folder above it; command
line values and job.dump_folder stay relative to the current directory (config/paths.py)."""

import os
from pathlib import Path

import pytest

from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.config.paths import PATH_KEYS, resolve_toml_path

ROOT = Path(__file__).resolve().parents[3]
DEBUG = ROOT / "train_configs" / "debug_model.toml"


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    return path


def test_next_to_the_toml_then_above_it_then_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the files lie outside the current directory: absolute paths
    toml = tmp_path / "exp" / "configs" / "run.toml"
    beside = touch(tmp_path / "exp" / "configs" / "data.jsonl")
    above = touch(tmp_path / "exp" / "assets" / "tok.tiktoken")
    assert resolve_toml_path("data.jsonl", str(toml)) == str(beside)
    assert resolve_toml_path("assets/tok.tiktoken", str(toml)) == str(above)
    touch(tmp_path / "exp" / "configs" / "assets" / "tok.tiktoken")  # the nearest folder wins
    assert resolve_toml_path("assets/tok.tiktoken", str(toml)).startswith(str(toml.parent))
    for value in ("missing/ckpt", "byte", "/abs/data.jsonl", ""):
        assert resolve_toml_path(value, str(toml)) == value


def test_load_config_resolves_input_paths_only(tmp_path, monkeypatch):
    for name in ("tok.tiktoken", "train.jsonl", "held_out.jsonl", "hf_model/config.json"):
        touch(tmp_path / "recipe" / name)
    (tmp_path / "recipe" / "out").mkdir()
    toml = tmp_path / "recipe" / "run.toml"
    toml.write_text(
        '[job]\ndump_folder = "out"\n[model]\ntokenizer_path = "tok.tiktoken"\n'
        '[training]\ndataset_path = "train.jsonl"\n'
        '[validation]\nenable = true\ndataset_path = "held_out.jsonl"\n'
        '[checkpoint]\ninitial_load_path = "hf_model"\ninitial_load_format = "hf"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    c = load_config(["--job.config_file", str(toml)])
    assert c.model.tokenizer_path == str(tmp_path / "recipe" / "tok.tiktoken")
    assert c.training.dataset_path == str(tmp_path / "recipe" / "train.jsonl")
    assert c.validation.dataset_path == str(tmp_path / "recipe" / "held_out.jsonl")
    assert c.checkpoint.initial_load_path == str(tmp_path / "recipe" / "hf_model")
    assert c.job.dump_folder == "out"  # an output: where the user launched
    # The command line is the shell's: relative to the current directory, never looked up.
    c = load_config(["--job.config_file", str(toml), "--training.dataset_path", "train.jsonl"])
    assert c.training.dataset_path == "train.jsonl"


def test_below_the_current_directory_keeps_a_relative_spelling(tmp_path, monkeypatch):
    touch(tmp_path / "assets" / "tok.tiktoken")
    toml = tmp_path / "configs" / "run.toml"
    toml.parent.mkdir()
    toml.write_text('[model]\ntokenizer_path = "assets/tok.tiktoken"\n')
    monkeypatch.chdir(tmp_path)
    c = load_config(["--job.config_file", "configs/run.toml"])
    assert c.model.tokenizer_path == os.path.join("assets", "tok.tiktoken")


@pytest.mark.parametrize("cwd", ["root", "elsewhere"])
def test_shipped_recipe_from_the_root_and_from_elsewhere(tmp_path, monkeypatch, cwd):
    monkeypatch.chdir(ROOT if cwd == "root" else tmp_path)
    c = load_config(["--job.config_file", str(DEBUG)])
    if cwd == "root":  # unchanged spelling: config.toml and reports read as before
        assert c.model.tokenizer_path == "assets/tokenizer/debug.tiktoken"
    else:
        assert c.model.tokenizer_path == str(ROOT / "assets" / "tokenizer" / "debug.tiktoken")
    assert os.path.isfile(c.model.tokenizer_path) and os.path.isfile(c.training.dataset_path)
    assert c.job.dump_folder == "./outputs/debug_model"


def test_path_keys_exist():
    c = load_config([])
    for key in PATH_KEYS:
        section, _, name = key.partition(".")
        assert hasattr(getattr(c, section), name), key


def test_a_list_of_dataset_paths_resolves_each_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    a = touch(tmp_path / "exp" / "a.jsonl")
    b = touch(tmp_path / "exp" / "b.jsonl")
    toml = touch(tmp_path / "exp" / "configs" / "mix.toml")
    toml.write_text('[training]\ndataset_path = ["a.jsonl", "b.jsonl"]\n')
    config = load_config(["--job.config_file", str(toml)])
    assert config.training.dataset_path == [str(a), str(b)]


def test_a_mixture_on_the_command_line_is_comma_separated(tmp_path, monkeypatch):
    from tests.helpers.data import BYTE, rows, write_jsonl
    from torchtitan_ablate.components.data import build_dataloader

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "a.jsonl", ["aaaa"] * 4)
    write_jsonl(tmp_path / "b,c.jsonl", ["bbbb"] * 4)  # a comma inside a name: written \,
    argv = ["--training.dataset_path", "a.jsonl,b\\,c.jsonl", "--training.dataset_weights"]
    t = load_config([*argv, "1,3", "--training.seq_len", "8"]).training
    assert t.dataset_path == ["a.jsonl", "b,c.jsonl"] and t.dataset_weights == [1.0, 3.0]
    tokens = [x for r in rows(build_dataloader(t, BYTE, 0, 1), 50) for x in r["input_ids"].tolist()]
    a, b = tokens.count(ord("a")), tokens.count(ord("b"))
    assert 0.15 < a / (a + b) < 0.35  # both sources, b three times as often
    assert load_config(["--training.dataset_path", "b\\,c.jsonl"]).training.dataset_path == (
        "b,c.jsonl"  # one path: a string, as in TOML
    )
    with pytest.raises(ConfigError, match=r"'b' does not exist while 'b,c.jsonl' does: write its"):
        load_config(["--training.dataset_path", "b,c.jsonl"])
    assert load_config(["--training.dataset_path", "x,y"]).training.dataset_path == ["x", "y"]

"""A checkpoint knows what made it. Its model sizes, LoRA settings, tokenizer and data are
recorded in it; a resume that would change the model is refused with one line (exit code 2)
before anything is written; config.toml is written only by a run that starts; export and
generation read the model from the checkpoint, whatever config.toml the latest launch left."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchtitan_ablate import train
from torchtitan_ablate.config import load_config, run_main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_checkpoint  # noqa: E402
import generate  # noqa: E402

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32"]
BASE += ["--training.local_batch_size", "2", "--metrics.log_freq", "1", "--model.n_layers", "2"]
BASE += ["--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8"]
CKPT = ["--training.steps", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step LoRA run of a 2-layer debug model (model.n_layers overridden) on a copy of the
    debug corpus, saved at step 2: its dump folder."""
    dump = tmp_path_factory.mktemp("trained")
    corpus = shutil.copy(ROOT / "assets/data/debug_corpus.jsonl", dump / "corpus.jsonl")
    args = ["--job.dump_folder", str(dump), "--training.dataset_path", str(corpus)]
    train.main(load_config(BASE + CKPT + args))
    return dump


def _copy(trained: Path, dump: Path) -> Path:
    """The trained dump folder copied to `dump`; returns its step-2."""
    shutil.copytree(trained, dump)
    return dump / "checkpoint" / "step-2"


def _resume(dump: Path, *args: str) -> list[dict]:
    more = ["--job.dump_folder", str(dump), "--training.steps", "3"]
    return run_main(train.main, BASE + CKPT + more + list(args))


def _refused(capsys, dump: Path, *args: str) -> str:
    """The one stderr line of a resume that must exit 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _resume(dump, *args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def _export(step: Path, out: Path) -> dict[str, torch.Tensor]:
    convert_checkpoint.main(["--to", "hf", str(step), str(out)])
    return load_file(out / "model.safetensors")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lora_checkpoint_exports_with_the_alpha_it_was_trained_with(trained, tmp_path, capsys):
    """Before: a resume with another lora.alpha went on silently, and the export merged with the
    alpha of whatever config.toml the latest launch wrote (one checkpoint, two exports)."""
    step = _copy(trained, tmp_path / "run")
    first = _export(step, tmp_path / "hf1")
    line = _refused(capsys, tmp_path / "run", "--lora.alpha", "16")
    assert line.startswith(
        f"config error: checkpoint {step} was trained with lora.alpha = 8.0, this run has 16.0:"
    )
    toml = tmp_path / "run" / "config.toml"
    written = toml.read_text()
    assert "\nalpha = 8.0\n" in written  # the refused launch did not rewrite it
    # A config.toml that says otherwise (an older version's failed launch wrote it) is not read.
    toml.write_text(written.replace("\nalpha = 8.0\n", "\nalpha = 16.0\n"))
    assert _same(_export(step, tmp_path / "hf2"), first)
    model, settings = generate.load_model(step, None, torch.device("cpu"))
    assert settings["lora.alpha"] == 8.0
    hf = generate.load_model(tmp_path / "hf1", None, torch.device("cpu"))[0]
    assert _same(model.state_dict(), hf.state_dict())


def test_a_failed_resume_leaves_config_toml_and_the_export_as_they_were(trained, tmp_path, capsys):
    """Before: every launch rewrote config.toml, so a failed --model.vocab_size 3000 resume
    broke the export of the untouched checkpoint."""
    step = _copy(trained, tmp_path / "run")
    toml = (tmp_path / "run" / "config.toml").read_bytes()
    line = _refused(capsys, tmp_path / "run", "--model.vocab_size", "3000")
    assert (tmp_path / "run" / "config.toml").read_bytes() == toml
    _export(step, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 2048
    assert line == (
        f"config error: checkpoint {step} holds another model than this run builds "
        "(model.vocab_size -1 -> 3000, vocab_size 2048 -> 3000): resume with model.vocab_size "
        "= -1, or start a new run in another job.dump_folder"
    )


def test_a_run_with_size_overrides_exports(trained, tmp_path):
    """Before: the export ignored model.n_layers (and num_experts) overrides: such a run could
    not be exported ("does not match the model sizes")."""
    weights = _export(_copy(trained, tmp_path / "run"), tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
    assert {k.split(".")[2] for k in weights if k.startswith("model.layers.")} == {"0", "1"}


def test_a_resume_on_another_tokenizer_or_other_data(trained, tmp_path, capsys, caplog):
    """Before: --model.tokenizer_path changed on resume went unnoticed, and an edited .jsonl
    corpus was read from the old byte offset ("invalid JSON" on a valid file)."""
    step = _copy(trained, tmp_path / "run")
    line = _refused(capsys, tmp_path / "run", "--model.tokenizer_path", "byte")
    assert line.startswith(f"config error: checkpoint {step} was trained with another tokenizer")
    edited = tmp_path / "edited.jsonl"
    lines = (trained / "corpus.jsonl").read_text().splitlines(keepends=True)
    edited.write_text('{"text": "a new first document"}\n' + "".join(lines[1:]))
    with caplog.at_level("INFO"):
        records = _resume(tmp_path / "run", "--training.dataset_path", str(edited))
    assert [r["step"] for r in records] == [3]
    data = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data changed")]
    restart = "(the data starts again from its first document)"
    assert data[0].startswith(f"data changed on resume: {edited} ") and data[0].endswith(restart)
    assert data[1:] == [
        f"data changed on resume: training.dataset_path {trained / 'corpus.jsonl'} -> {edited} "
        + restart
    ]

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ablate.config import ConfigError, JobConfig, load_config, to_toml
from torchtitan_ablate.config.reference import field_docs, render_markdown

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_precedence_defaults_toml_cli(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n")
    c = load_config(["--job.config_file", path, "--training.steps=3"])
    assert c.training.steps == 3  # CLI beats TOML
    assert c.training.seq_len == 64  # TOML beats default
    assert c.optimizer.lr == 0.01
    assert c.training.local_batch_size == JobConfig().training.local_batch_size


def test_cli_forms_and_types():
    c = load_config(
        [
            "--compile.enable",
            "--training.deterministic=true",
            "--checkpoint.enable",
            "false",
            "--model.attn_backend",
            "flex",
            "--float8.filter_fqns",
            "output,router,gate",
            "--lr_scheduler.decay_ratio",
            "0.2",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ]
    )
    assert c.compile.enable is True and c.training.deterministic is True
    assert c.checkpoint.enable is False
    assert c.model.attn_backend == "flex"
    assert c.float8.filter_fqns == ["output", "router", "gate"]
    assert c.lr_scheduler.decay_ratio == 0.2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--trainig.steps", "3"], "unknown config section [trainig]"),
        (["--training.stepz", "3"], "unknown key 'training.stepz'"),
        (["--training.steps", "three"], "training.steps = 'three' is not valid; expected an int"),
        (["--model.attn_backend", "foo"], "one of 'auto', 'sdpa', 'flex', 'varlen', 'flash'"),
        (["--compile.enable", "yes"], "expected true/false"),
        (["--job.config_file", "/nonexistent.toml"], "no such file"),
        (["training.steps"], "cannot read argument"),
        (["--training.steps", "0"], "training.steps = 0"),
        (["--training.packing", "best_fit"], "packs whole conversations"),
    ],
)
def test_bad_input_is_one_clear_error(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args, value",
    [
        (["--optimizer.lr", "inf"], "'inf'"),
        (["--optimizer.lr", "nan"], "'nan'"),
        (["--training.max_norm", "-inf"], "'-inf'"),
        (["--lr_scheduler.decay_ratio", "nan"], "'nan'"),  # float | None
        (["--optimizer.eps", "1e999"], "'1e999'"),  # overflows to inf
    ],
)
def test_cli_nan_and_inf_are_rejected(args, value):
    key = args[0][2:]
    with pytest.raises(ConfigError, match="expected a finite number") as e:
        load_config(args)
    assert f"{key} = {value}" in str(e.value)


@pytest.mark.parametrize(
    "line, key",
    [
        ("[optimizer]\nlr = inf\n", "optimizer.lr"),
        ("[optimizer]\nlr = nan\n", "optimizer.lr"),
        ("[training]\nmax_norm = -inf\n", "training.max_norm"),
        ("[lr_scheduler]\ndecay_ratio = nan\n", "lr_scheduler.decay_ratio"),
        ("[lora]\nalpha = " + "9" * 400 + "\n", "lora.alpha"),  # an int too large for a float
    ],
)
def test_toml_nan_and_inf_are_rejected(tmp_path, line, key):
    with pytest.raises(ConfigError, match=f"{re.escape(key)} = .*expected a finite number"):
        load_config(["--job.config_file", write(tmp_path, line)])


def test_toml_errors_name_file_and_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'training.foo'"):
        load_config(["--job.config_file", write(tmp_path, "[training]\nfoo = 1\n")])
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(["--job.config_file", write(tmp_path, '[training]\nsteps = "10"\n')])
    with pytest.raises(ConfigError, match="cannot read TOML"):
        load_config(["--job.config_file", write(tmp_path, "[training\n")])
    with pytest.raises(ConfigError, match="expected true/false"):
        load_config(["--job.config_file", write(tmp_path, "[compile]\nenable = 1\n")])


def test_resolved_config_round_trips(tmp_path):
    c = load_config(["--training.steps", "9", "--model.flavor", "debugmodel_moe"])
    path = write(tmp_path, to_toml(c))
    c.job.config_file = path
    assert load_config(["--job.config_file", path]) == c


def test_every_field_has_a_docstring():
    docs = field_docs()
    for section in dataclasses.fields(JobConfig):
        cls = section.type
        missing = [f.name for f in dataclasses.fields(cls) if not docs[cls.__name__].get(f.name)]
        assert not missing, f"[{section.name}] fields without a docstring: {missing}"
    assert "| `steps` |" in render_markdown()


def test_cli_exit_code_2_without_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "torchtitan_ablate.train", "--training.steps", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "config error: command line: training.steps = 'x' is not valid; expected an integer"
    ]


@pytest.mark.parametrize("path", sorted((ROOT / "train_configs").glob("*.toml")))
def test_shipped_configs_validate(path):
    load_config(["--job.config_file", str(path)])


def test_config_reference_doc_is_current():
    doc = (ROOT / "docs" / "config_reference.md").read_text()
    assert doc == render_markdown() + "\n", "run: python scripts/config_reference.py"

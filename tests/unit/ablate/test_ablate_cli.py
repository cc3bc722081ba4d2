"""`ttablate-ablate` (ablate/cli.py): its help, and the one-line refusal where the install has
no checkout whose run_train.sh it could launch (a --report still works there)."""

import pytest

from torchtitan_ablate.ablate import cli


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: ttablate-ablate ")
    assert "--set SECTION.KEY=VALUE" in out and "--report DIR" in out


def test_outside_a_checkout_planning_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "ROOT", tmp_path)  # an install without run_train.sh
    monkeypatch.chdir(tmp_path)
    assert cli.main(["study.toml", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run_train.sh" in err[0] and "pip install -e ." in err[0]
    # --report reads run folders only: a missing plan is its own one-line error.
    assert cli.main(["--report", str(tmp_path / "out")]) == 2
    assert "ablation.json" in capsys.readouterr().err


STUDY = """
[ablation]
config_file = "train_configs/debug_model.toml"
steps = 2

[variants.a]
training.seq_len = 32
"""


def test_a_rerun_never_deletes_earlier_runs_unasked(tmp_path, monkeypatch, capsys):
    study, out = tmp_path / "study.toml", tmp_path / "out"
    study.write_text(STUDY)
    ran = []
    monkeypatch.setattr(cli, "_run_study", lambda plan, out, resume, *rest: ran.append(resume))
    earlier = out / "runs" / "a" / "seed42" / "metrics.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"step": 1, "loss": 5.0}\n')
    base = [str(study), "--out", str(out), "--no-estimate"]
    assert cli.main(base) == 2 and not ran and earlier.is_file()
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("ablation error")]
    assert err == [
        f"ablation error: --out {out} holds 1 run folder(s) of an earlier call (runs/a/seed42): "
        "--resume continues that study (finished runs are kept), another --out keeps both, "
        "--overwrite deletes them and starts afresh"
    ]
    assert cli.main([*base, "--only", "a"]) == 2 and not ran  # a part of a study: --resume
    cli.main([*base, "--resume"])
    assert ran == [True] and earlier.is_file()
    cli.main([*base, "--overwrite"])
    assert ran == [True, False] and not earlier.exists()
    assert "--overwrite: deleted the 1 earlier run folder(s)" in capsys.readouterr().out
    cli.main(base)  # nothing earlier left: no question asked
    assert ran == [True, False, False]
    with pytest.raises(SystemExit) as e:
        cli.main([*base, "--resume", "--overwrite"])
    assert e.value.code == 2 and "--overwrite deletes the earlier runs" in capsys.readouterr().err

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

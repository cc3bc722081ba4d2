"""Empty inputs stop a run before the model is built, with one line naming the file (exit code
2): an empty .jsonl corpus, an empty .tiktoken tokenizer; so does W&B enabled without its
package or without a login (a fake wandb module: no network)."""

import contextlib
import io
import sys
import types

import pytest

from torchtitan_ablate import train
from torchtitan_ablate.config import run_main

ARGS = ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", "1"]


@pytest.mark.parametrize(
    ("key", "name", "line"),
    [
        ("--training.dataset_path", "empty.jsonl",
         "config error: training.dataset_path: {path} holds no documents (only blank lines); "
         "give a non-empty dataset"),
        ("--model.tokenizer_path", "empty.tiktoken",
         "config error: model.tokenizer_path = '{path}': cannot read it as a tokenizer: {path} "
         "holds no token (an empty file), not one '<base64> <rank>' line; accepted: "),
    ],
    ids=["jsonl", "tiktoken"],
)  # fmt: skip
def test_an_empty_input_stops_the_run_before_the_model(tmp_path, monkeypatch, key, name, line):
    path = tmp_path / name
    path.write_text("")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the inputs were checked")

    monkeypatch.setattr(train, "build_run", no_model)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_main(train.main, [*ARGS, "--job.dump_folder", str(tmp_path / "run"), key, str(path)])
    assert e.value.code == 2
    lines = [x for x in err.getvalue().splitlines() if "error" in x or "Traceback" in x]
    assert len(lines) == 1 and lines[0].startswith(line.format(path=path)), lines


def _wandb_without_login() -> types.ModuleType:
    """A wandb module whose init raises what the real one raises without `wandb login` (and no
    WANDB_API_KEY) when it cannot prompt: wandb.errors.UsageError."""
    errors = types.ModuleType("wandb.errors")
    errors.Error = type("Error", (Exception,), {})
    errors.UsageError = type("UsageError", (errors.Error,), {})

    def init(**kwargs):
        raise errors.UsageError(
            "api_key not configured (no-tty). call wandb.login(key=[your_api_key])"
        )

    wandb = types.ModuleType("wandb")
    wandb.errors, wandb.init = errors, init
    return wandb


@pytest.mark.parametrize("case", ["no_login", "not_installed"])
def test_wandb_that_cannot_start_stops_the_run_before_the_model(tmp_path, monkeypatch, case):
    from torchtitan_ablate.components.observability import trackers

    if case == "no_login":
        monkeypatch.setitem(sys.modules, "wandb", _wandb_without_login())
        line = (
            "config error: metrics.enable_wandb = true, but W&B could not start a run (UsageError:"
            " api_key not configured (no-tty). call wandb.login(key=[your_api_key])): run `wandb "
            "login` or set WANDB_API_KEY, or log offline with metrics.wandb_mode = offline "
            "(upload later with `wandb sync`), or set metrics.enable_wandb = false"
        )
    else:
        monkeypatch.delitem(sys.modules, "wandb", raising=False)
        monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
        line = (
            "config error: metrics.enable_wandb = true needs wandb, which is not installed: pip "
            "install wandb (or the project's wandb extra), or set metrics.enable_wandb = false"
        )

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before W&B started")

    monkeypatch.setattr(train, "build_run", no_model)
    monkeypatch.setattr(train, "build_data", no_model)
    args = [*ARGS, "--job.dump_folder", str(tmp_path / "run"), "--metrics.enable_wandb", "true"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_main(train.main, args)
    assert e.value.code == 2
    assert [x for x in err.getvalue().splitlines() if "error" in x or "Traceback" in x] == [line]

"""Empty inputs stop a run before the model is built, with one line naming the file (exit code
2): an empty .jsonl corpus, an empty .tiktoken tokenizer."""

import contextlib
import io

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

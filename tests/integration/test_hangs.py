"""Hangs end: a step that outlives the SIGTERM grace ends the process with one line (exit code
143, the older checkpoints kept, the dump folder unlocked); a chat template is tried before the
model is built, with a time limit, and any failure of it is one line (exit code 2)."""

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.hf_tokenizer import make_chat_tokenizer_folder
from torchtitan_ablate import train
from torchtitan_ablate.components.text import chat_template
from torchtitan_ablate.config import run_main

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32"]
ARGS += ["--training.local_batch_size", "2", "--training.steps", "5", "--checkpoint.enable"]
ARGS += ["--checkpoint.interval", "1"]

# The trainer, with step 2 signalled and then stuck for an hour (as a hung data read would be).
STUCK_AT_STEP_2 = """
import os, signal, sys, time
from torchtitan_ablate import train
from torchtitan_ablate.config import run_main

real_step = train.Trainer.train_step

def stuck_step(self, batches):
    if self.step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3600)
    return real_step(self, batches)

train.Trainer.train_step = stuck_step
run_main(train.main, sys.argv[1:])
"""


def test_a_step_that_outlives_the_sigterm_grace_is_one_line_and_exit_143(tmp_path):
    args = [*ARGS, "--job.dump_folder", str(tmp_path), "--training.sigterm_grace_seconds", "1"]
    done = subprocess.run([sys.executable, "-c", STUCK_AT_STEP_2, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    errors = [x for x in done.stderr.splitlines() if x.startswith(("error", "Traceback"))]
    assert done.returncode == 143, done.stderr[-3000:]
    assert errors == [
        "error: step 2 did not end within training.sigterm_grace_seconds = 1 s of SIGTERM (a "
        "hung data read, template or collective): stopped without saving it (newest "
        "checkpoint: step-1)"
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    assert not (tmp_path / "run.lock").exists()


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
REPLY = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (LOOPS + REPLY, "took more than 1 s to render a sample conversation (tried before "
         "training) (an endless loop?)"),
        ("{{ raise_exception('Conversations must start with a system message') }}",
         "fails on a sample conversation (tried before training): the template raised "
         "'Conversations must start with a system message'"),
    ],
    ids=["endless_loop", "raise_exception"],
)  # fmt: skip
def test_a_chat_template_that_fails_stops_the_run_before_the_model(
    tmp_path, monkeypatch, template, why
):
    texts = (ROOT / "assets/sft/debug_chat.jsonl").read_text().split('"')  # the chats' words
    folder = make_chat_tokenizer_folder(tmp_path / "tok", template, texts)
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)  # 10 s by default

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the template was tried")

    monkeypatch.setattr(train, "build_run", no_model)
    args = [*ARGS, "--job.dump_folder", str(tmp_path / "run"), "--training.dataset", "chat"]
    args += ["--training.dataset_path", "assets/sft/debug_chat.jsonl"]
    args += ["--model.tokenizer_path", str(folder)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_main(train.main, args)
    assert e.value.code == 2
    assert [x for x in err.getvalue().splitlines() if "error" in x or "Traceback" in x] == [
        f"config error: model.tokenizer_path: the chat_template of {folder}/tokenizer_config.json "
        f"{why}; fix it, or remove chat_template to render chats in the built-in Qwen format"
    ]

"""The data checks a run gets before and while it trains: every line read once up front, one
warning when a shard's data starts over, loader workers that outlive a job-wide SIGTERM."""

import json
import logging
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.data import loader, rows, write_jsonl
from torchtitan_ablate.components.data.datasets import TextDocuments
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import ConfigError

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_a_bad_line_deep_in_the_file_fails_when_the_loader_is_built(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [f"document {i}" for i in range(299)])
    with open(path, "a") as f:
        f.write('{"text": "cut off\n')
    with pytest.raises(ConfigError, match=r"d.jsonl:300: invalid JSON"):
        loader(path)  # before: only when training reached line 300


def test_chat_lines_are_checked_up_front(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps({"messages": "hi"}) + "\n")
    tok = build_tokenizer("assets/tokenizer/debug.tiktoken")
    with pytest.raises(ConfigError, match=r'chat.jsonl:2: expected \{"messages"'):
        loader(path, dataset="chat", tokenizer=tok)


def test_the_check_stops_after_its_byte_budget(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["fine"] * 10)
    with open(path, "a") as f:
        f.write("not json\n")
    source = TextDocuments([path], build_tokenizer("byte"))
    assert source.check_lines(max_bytes=50) is False  # stopped before the bad line
    with pytest.raises(ConfigError, match=":11: invalid JSON"):
        source.check_lines()


def test_data_that_starts_over_warns_once_with_the_numbers(tmp_path, caplog) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["aaaa", "bbbbbb", "cc"])  # 15 tokens with EOS
    with caplog.at_level(logging.WARNING, logger="torchtitan_ablate"):
        rows(loader(path), 12)  # 12 rows of 16 tokens: the data runs out many times
    (warning,) = [r.getMessage() for r in caplog.records if "starts over" in r.getMessage()]
    assert "d.jsonl: the data has been read to the end (3 documents, 12 tokens) and starts " in (
        warning
    )
    assert "over (epoch 2): the rest of the run repeats data" in warning


def test_a_shards_warning_names_the_shard(tmp_path, caplog) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["aaaa", "bbbbbb", "cc", "d"])
    with caplog.at_level(logging.WARNING, logger="torchtitan_ablate"):
        rows(loader(path, dp_rank=1, dp_world_size=2), 4)
    (warning,) = [r.getMessage() for r in caplog.records if "starts over" in r.getMessage()]
    assert "shard 1 of 2 (data-parallel ranks x workers) has been read to the end (its 2 of " in (
        warning
    )


def test_loader_workers_outlive_a_sigterm_not_their_trainers_and_a_ctrl_c(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [f"document {i}" for i in range(50)])
    dl = loader(path, num_workers=1)
    it = iter(dl)
    next(it)
    worker = it._workers[0]  # torch's own list of this iterator's worker processes
    # Another process's SIGTERM (torchrun's or a scheduler's, sent to the whole job): ignored.
    subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
    # A terminal's Ctrl-C reaches every process of its foreground group: the trainer's alone.
    subprocess.run(["kill", "-INT", str(worker.pid)], check=True)
    time.sleep(0.5)
    assert worker.is_alive()
    for _ in range(5):
        next(it)
    # The training process's own SIGTERM (how multiprocessing ends workers at exit) ends it.
    worker.terminate()
    worker.join(timeout=10)
    assert worker.exitcode is not None
    assert signal.SIGTERM not in (worker.exitcode, -worker.exitcode)  # it left on its own
    it._shutdown_workers()

"""What identifies a run's data files and tokenizer: their contents, not their paths or times."""

import os
import shutil
from pathlib import Path

from torchtitan_ablate.components.checkpoint import fingerprints
from torchtitan_ablate.components.checkpoint.fingerprints import data_files, tokenizer_identity
from torchtitan_ablate.config.job_config import Training

ROOT = Path(__file__).resolve().parents[4]
TOKENIZER = ROOT / "assets/tokenizer/debug.tiktoken"


def _contents(training: Training) -> list[tuple[int, str]]:
    return [(size, digest) for _, size, digest in data_files(training)]


def test_data_files_are_known_by_their_contents(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("one paragraph\n\nanother one\n")
    training = Training(dataset="text", dataset_path=str(corpus))
    ((path, size, digest),) = data_files(training)
    assert (path, size) == (str(corpus), corpus.stat().st_size) and digest.startswith("blake2b ")

    os.utime(corpus, (1, 1))  # touched: the same data
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(corpus, moved / "c.txt")  # a copy elsewhere: the same data
    assert _contents(Training(dataset="text", dataset_path=str(moved))) == [(size, digest)]
    corpus.write_text("one paragraph\n\nanother 1ne\n")  # the same size, other bytes
    assert _contents(training) != [(size, digest)]
    assert data_files(Training(dataset="synthetic")) == []


def test_past_the_budget_a_file_is_known_by_its_size_and_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprints, "DATA_HASH_BYTES", 100)
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "a"}\n' * 5)  # 70 bytes: hashed whole
    big = folder / "b.jsonl"
    big.write_bytes(b"x" * (3 * 2**20))
    first, second = data_files(Training(dataset="text", dataset_path=str(folder)))
    assert first[2].startswith("blake2b ") and second[2].startswith("ends blake2b ")
    with open(big, "r+b") as f:  # the last MiB changes: seen
        f.seek(3 * 2**20 - 1)
        f.write(b"y")
    assert data_files(Training(dataset="text", dataset_path=str(folder)))[1] != second


def test_a_tokenizer_is_known_by_its_file(tmp_path):
    same = tmp_path / "same.tiktoken"
    shutil.copy(TOKENIZER, same)
    assert tokenizer_identity(str(same)) == tokenizer_identity(str(TOKENIZER))
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(TOKENIZER, folder / "debug.tiktoken")  # a folder names its tokenizer file
    assert tokenizer_identity(str(folder)) == tokenizer_identity(str(TOKENIZER))
    lines = TOKENIZER.read_text().splitlines()
    (tmp_path / "other.tiktoken").write_text("\n".join(lines[:-1]) + "\n")
    assert tokenizer_identity(str(tmp_path / "other.tiktoken")) != tokenizer_identity(str(same))
    assert tokenizer_identity("byte") == "byte"

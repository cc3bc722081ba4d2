"""The benchmark corpus (components/data/bench_corpus.py, scripts/make_bench_corpus.py) built
from a small fake stdlib folder: deterministic, split, recorded, checked, and its tokenizer."""

import json
import runpy
from pathlib import Path

import pytest

from torchtitan_ablate.components.text import bench_corpus as bc
from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.config import ConfigError

VOCAB = 320
WORDS = "the parser returns a list of tokens when each line holds one value".split()


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stdlib")
    for i in range(60):  # sizes from one line to a few thousand words, as real files
        body = " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1 + (i * 37) % 3000))
        pkg = root / ("email" if i % 3 else "") / f"mod{i:02d}.py"
        pkg.parent.mkdir(exist_ok=True)
        pkg.write_text(f'"""Module {i}: {body}."""\n\ndef f{i}(x):\n    return x + {i}\n')
    (root / "LICENSE.txt").write_text("Permission is granted, free of charge.\n")
    (root / "notes.rst").write_text("Title\n=====\n\nSome *text*.\n")
    # Left out: excluded folders, build-specific modules, non-UTF-8, blank, other suffixes.
    for skipped in ("site-packages/x.py", "test/test_x.py", "__pycache__/y.py"):
        (root / skipped).parent.mkdir(exist_ok=True)
        (root / skipped).write_text("print('not a document of the corpus')\n")
    (root / "_sysconfigdata__linux.py").write_text("build_time_vars = {}\n")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "__init__.py").write_text("\n\n")
    (root / "data.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def built(stdlib, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("corpus")
    return out, bc.build(out, stdlib, VOCAB)


def read_texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_documents_split_and_manifest(stdlib, built):
    out, manifest = built
    docs = bc.list_sources(stdlib)
    names = [rel for rel, _ in docs]
    assert len(names) == 62 and "LICENSE.txt" in names and "notes.rst" in names
    assert not [n for n in names if n.startswith(("site-packages", "test/", "_sysconfig"))]
    train, heldout = read_texts(out / bc.TRAIN), read_texts(out / bc.HELDOUT)
    # Every 50th file in path order is held out; each file is one whole document.
    assert heldout == [docs[0][1], docs[50][1]]
    assert sorted(train) == sorted(t for i, (_, t) in enumerate(docs) if i % 50)
    assert manifest["documents"] == {"train": 60, "heldout": 2}
    assert manifest["bytes"]["train"] == sum(map(len, train))
    assert manifest == json.loads((out / bc.MANIFEST).read_text())
    assert set(manifest["files"]) == set(bc.OUTPUTS) and manifest["python"]


def test_build_is_deterministic(stdlib, built, tmp_path):
    out, manifest = built
    again = bc.build(tmp_path, stdlib, VOCAB)
    assert again == manifest
    for name in (*bc.OUTPUTS, bc.MANIFEST):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_tokenizer_round_trips_within_its_vocabulary(built):
    out, manifest = built
    tok = build_tokenizer(str(out / bc.TIKTOKEN))
    as_json = build_tokenizer(str(out / "tokenizer"))  # the folder loads tokenizer.json
    assert tok.vocab_size == manifest["vocab_size"] == VOCAB
    texts = read_texts(out / bc.TRAIN) + read_texts(out / bc.HELDOUT)
    tokens = 0
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and max(ids) < tok.vocab_size
        assert as_json.encode(text) == ids
        tokens += len(ids) + 1
    assert tokens == sum(manifest["tokens"].values())


def test_check_detects_a_change(stdlib, tmp_path, capsys):
    script = runpy.run_path("scripts/make_bench_corpus.py")["main"]
    args = ["--out", str(tmp_path / "c"), "--stdlib", str(tmp_path / "s"), "--vocab-size", "300"]
    (tmp_path / "s").mkdir()
    for name in ("a.py", "b.py"):
        (tmp_path / "s" / name).write_text((stdlib / "mod06.py").read_text() + name)
    with pytest.raises(SystemExit) as e:
        script([*args, "--check"])  # nothing built yet
    assert e.value.code == 1 and "no benchmark corpus there" in capsys.readouterr().err
    script(args)
    train = tmp_path / "c" / bc.TRAIN
    built_at = train.stat().st_mtime_ns
    script([*args, "--check"])
    script(args)  # current: not rebuilt
    assert "nothing to build" in capsys.readouterr().err and train.stat().st_mtime_ns == built_at
    (tmp_path / "s" / "b.py").write_text("changed = True\n")
    with pytest.raises(SystemExit) as e:
        script([*args, "--check"])
    assert e.value.code == 1 and "sources under" in capsys.readouterr().err
    script(args)
    train.write_text(train.read_text().replace("changed", "edited"))
    with pytest.raises(SystemExit) as e:
        script([*args, "--check"])
    assert e.value.code == 1 and "differs from its manifest hash" in capsys.readouterr().err
    script([*args, "--overrides"])  # rebuilds, then prints the recipe overrides
    printed = capsys.readouterr().out.split()
    assert printed == bc.overrides(tmp_path / "c") and "changed" in train.read_text()


def test_with_corpus_adds_the_overrides_or_fails_in_one_line(built, tmp_path):
    out, manifest = built
    argv = ["--job.config_file", "train_configs/debug_model.toml"]
    assert bc.with_corpus(None, argv) == (argv, None)
    new_argv, identity = bc.with_corpus(str(out), argv)
    assert new_argv == argv + bc.overrides(out)
    assert identity == {"folder": str(out), "content_hash": manifest["content_hash"]} | {
        "python": manifest["python"]
    }
    with pytest.raises(ConfigError, match="no benchmark corpus there; build it"):
        bc.with_corpus(tmp_path, argv)
    with pytest.raises(ConfigError, match="the benchmark corpus sets it"):
        bc.with_corpus(out, [*argv, "--model.tokenizer_path=byte"])

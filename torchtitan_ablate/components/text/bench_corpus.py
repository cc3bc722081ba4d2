"""The benchmark corpus: real text built offline from this Python's standard library.

Every *.py, *.txt and *.rst file under sysconfig's stdlib path is one document, kept whole
(a few bytes to several hundred kB), except the parts that installs split off or add (site
packages, test suites, idlelib, tkinter, build-time config): two installs of the same Python
version then give the same corpus. Files in sorted path order; every HELDOUT_EVERY-th goes to
the held-out split, the rest are shuffled with a fixed seed. A byte-level BPE is fitted to the
training split. Layout of the output folder:

  train.jsonl, heldout.jsonl      {"text": ...} per line
  tokenizer/bench.tiktoken        the ranks (the engine's format; 3 specials follow them)
  tokenizer/tokenizer.json        the same tokenizer for Hugging Face `tokenizers`
  tokenizer/tokenizer_config.json eos = pad = <|endoftext|>, no bos
  manifest.json                   Python version, counts, sha256 per file, and content_hash
                                  over them: figures compare only at an equal content_hash
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import sysconfig
from pathlib import Path

import regex

from torchtitan_ablate.components.text import bpe
from torchtitan_ablate.components.text.bpe import (
    count_pretokens,
    hf_tokenizer_json,
    train_bpe,
    write_atomically,
)
from torchtitan_ablate.components.text.tokenizer import (
    TIKTOKEN_SPECIALS,
    TiktokenTokenizer,
    save_tiktoken_ranks,
)
from torchtitan_ablate.config import ConfigError

DEFAULT_OUT = Path("outputs/bench_corpus")
VOCAB_SIZE = 8192  # ids including the specials; the models keep their own vocab_size
HELDOUT_EVERY = 50
SEED = 0
SUFFIXES = (".py", ".txt", ".rst")
# Split off into separate packages by distributions (Debian: the test suite, idlelib, tkinter,
# ensurepip, lib2to3, distutils) or specific to one install.
EXCLUDED_DIRS = (
    "__pycache__",
    "dist-packages",
    "distutils",
    "ensurepip",
    "idlelib",
    "lib-dynload",
    "lib2to3",
    "site-packages",
    "test",
    "tests",
    "tkinter",
    "turtledemo",
)
# Build paths of this install, and the site's own hook.
EXCLUDED_PREFIXES = ("_sysconfigdata", "sitecustomize")
TRAIN, HELDOUT, MANIFEST = "train.jsonl", "heldout.jsonl", "manifest.json"
TIKTOKEN = "tokenizer/bench.tiktoken"
HF_FILES = ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")
OUTPUTS = (TRAIN, HELDOUT, TIKTOKEN, *HF_FILES)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "add_bos_token": False,
    "add_eos_token": False,
}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[tuple[str, str]]:
    """(path relative to root, text) of every source document, in sorted path order; files
    that are not UTF-8 or hold only whitespace are left out."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        for name in files:
            if name.endswith(SUFFIXES) and not name.startswith(EXCLUDED_PREFIXES):
                found.append(Path(folder, name))
    docs = []
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append((path.relative_to(root).as_posix(), text))
    return docs


def _settings(vocab_size: int) -> dict:
    """What the outputs depend on besides the sources, the builder code included."""
    code = hashlib.sha256()
    for module in (Path(__file__), Path(bpe.__file__)):
        code.update(module.read_bytes())
    return {
        "vocab_size": vocab_size,
        "heldout_every": HELDOUT_EVERY,
        "seed": SEED,
        "builder_sha256": code.hexdigest(),
    }


def _sources_hash(docs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, text in docs:
        h.update(f"{rel}\0{len(text)}\0".encode())
        h.update(text.encode("utf-8"))
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _content_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _write_jsonl(path: Path, texts: list[str]) -> None:
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    write_atomically(path, lambda tmp: tmp.write_text(body, encoding="ascii"))


def _write_json(path: Path, data: dict) -> None:
    body = json.dumps(data, indent=1, sort_keys=True, ensure_ascii=True) + "\n"
    write_atomically(path, lambda tmp: tmp.write_text(body, encoding="ascii"))


def read_manifest(out: Path) -> dict:
    """The manifest of a built corpus; ValueError naming the fix when there is none."""
    try:
        return json.loads((out / MANIFEST).read_text("utf-8"))
    except (OSError, ValueError):
        raise ValueError(
            f"{out}: no benchmark corpus there; build it: python scripts/make_bench_corpus.py "
            f"--out {out}"
        ) from None


def stale_reasons(out: Path, root: Path, vocab_size: int = VOCAB_SIZE) -> list[str]:
    """Why the corpus in `out` is not what a build from `root` would write (empty: current)."""
    try:
        manifest = read_manifest(out)
    except ValueError as e:
        return [str(e)]
    reasons = []
    if manifest.get("settings") != _settings(vocab_size):
        reasons.append("the build settings or the builder code changed")
    if manifest.get("sources_sha256") != _sources_hash(list_sources(root)):
        reasons.append(f"the sources under {root} changed")
    return reasons + damaged_files(out, manifest)


def damaged_files(out: Path, manifest: dict) -> list[str]:
    """The output files that are missing or differ from the manifest's hashes."""
    recorded, reasons = manifest.get("files", {}), []
    for name in OUTPUTS:
        path = out / name
        if not path.is_file():
            reasons.append(f"{path}: missing")
        elif recorded.get(name) != _sha256(path):
            reasons.append(f"{path}: differs from its manifest hash")
    return reasons


def overrides(out: Path) -> list[str]:
    """Command-line overrides that train a recipe on the corpus in `out`."""
    return [
        "--training.dataset",
        "text",
        "--training.dataset_path",
        str(out / TRAIN),
        "--model.tokenizer_path",
        str(out / TIKTOKEN),
    ]


def with_corpus(out: str | Path | None, argv: list[str]) -> tuple[list[str], dict | None]:
    """argv plus overrides(out), and what identifies the corpus in a result (folder, Python,
    content_hash); ConfigError when it is not built, damaged, or argv sets the same keys.
    out None (no corpus asked for): argv as given, None."""
    if out is None:
        return argv, None
    out = Path(out)
    try:
        manifest = read_manifest(out)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    damaged = damaged_files(out, manifest)
    if damaged:
        raise ConfigError(f"{damaged[0]}; rebuild: python scripts/make_bench_corpus.py --out {out}")
    keys = [k for k in overrides(out) if k.startswith("--")]
    clash = [a for a in argv if a.split("=")[0] in keys]
    if clash:
        raise ConfigError(f"{clash[0]}: the benchmark corpus sets it; give one or the other")
    identity = {k: manifest[k] for k in ("content_hash", "python")}
    return argv + overrides(out), {"folder": str(out), **identity}


def build(out: Path, root: Path, vocab_size: int = VOCAB_SIZE) -> dict:
    """Write the corpus, its tokenizer and the manifest (last) into `out`; returns the
    manifest."""
    docs = list_sources(root)
    if not docs:
        raise ValueError(f"{root}: no {'/'.join(SUFFIXES)} files with text")
    heldout = [text for i, (_, text) in enumerate(docs) if i % HELDOUT_EVERY == 0]
    train = [text for i, (_, text) in enumerate(docs) if i % HELDOUT_EVERY != 0]
    random.Random(SEED).shuffle(train)
    ranks = train_bpe(count_pretokens(train), vocab_size - len(TIKTOKEN_SPECIALS))
    specials = {name: len(ranks) + i for i, name in enumerate(TIKTOKEN_SPECIALS)}
    _write_jsonl(out / TRAIN, train)
    _write_jsonl(out / HELDOUT, heldout)
    write_atomically(out / TIKTOKEN, lambda tmp: save_tiktoken_ranks(ranks, tmp))
    _write_json(out / HF_FILES[0], hf_tokenizer_json(ranks, specials))
    _write_json(out / HF_FILES[1], TOKENIZER_CONFIG)
    encoding = TiktokenTokenizer("bench", ranks, specials).encoding
    files = {name: _sha256(out / name) for name in OUTPUTS}
    manifest = {
        "content_hash": _content_hash(files),
        "python": platform.python_version(),
        "regex": regex.__version__,  # its Unicode tables split the text before BPE
        "stdlib": str(root),
        "sources_sha256": _sources_hash(docs),
        "settings": _settings(vocab_size),
        "documents": {"train": len(train), "heldout": len(heldout)},
        "bytes": {"train": sum(map(len, train)), "heldout": sum(map(len, heldout))},
        # One <|endoftext|> per document, as both engines pack them.
        "tokens": {
            name: sum(len(ids) + 1 for ids in encoding.encode_ordinary_batch(texts))
            for name, texts in (("train", train), ("heldout", heldout))
        },
        "vocab_size": len(ranks) + len(specials),
        "files": files,
    }
    _write_json(out / MANIFEST, manifest)
    return manifest


def hf_id_mismatch(out: Path, splits: tuple[str, ...] = (HELDOUT, TRAIN)) -> str | None:
    """Where Hugging Face `tokenizers` (the torchtitan peer's loader) and this engine's loader
    give different ids for the documents of `splits`; None when they agree everywhere."""
    from tokenizers import Tokenizer

    from torchtitan_ablate.components.text.tokenizer import build_tokenizer

    hf = Tokenizer.from_file(str(out / HF_FILES[0]))
    ours = build_tokenizer(str(out / "tokenizer"))
    for split in splits:
        lines = (out / split).read_text("ascii").splitlines()
        texts = [json.loads(line)["text"] for line in lines]
        for i, enc in enumerate(hf.encode_batch(texts, add_special_tokens=False)):
            if enc.ids != ours.encode(texts[i]):
                return f"{out / split} document {i}: tokenizers and tiktoken ids differ"
    return None

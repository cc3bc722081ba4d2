"""Build the real-text benchmark corpus and its tokenizer, offline, from Python's stdlib.

    python scripts/make_bench_corpus.py [--out DIR] [--check] [--overrides]
        [--stdlib SRC] [--vocab-size 8192]

DIR (default outputs/bench_corpus) receives train.jsonl, heldout.jsonl (every 50th source file),
tokenizer/ (bench.tiktoken, and the same tokenizer as tokenizer.json for Hugging Face
`tokenizers`) and manifest.json (Python version, token counts, sha256 per file, content_hash).
Speed figures compare only at an equal content_hash: another Python version gives another corpus.
A build whose manifest still matches its sources and files is skipped (a build takes 10 s to
about a minute on one core).

  --check       verify DIR against the sources and its manifest, write nothing (exit 1 if stale);
                where `tokenizers` is installed, also that it gives the engine's ids for every
                document (a build compares the held-out ones)
  --overrides   build if needed, then print the command-line overrides that point a recipe at
                the corpus, for `./run_train.sh --job.config_file X $(python ... --overrides)`
  --stdlib SRC  read the documents from SRC instead of this interpreter's stdlib folder
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from torchtitan_ablate.components.text.bench_corpus import (
    DEFAULT_OUT,
    HELDOUT,
    TRAIN,
    VOCAB_SIZE,
    build,
    hf_id_mismatch,
    overrides,
    stale_reasons,
    stdlib_root,
)


def _log(message: str) -> None:
    print(f"make_bench_corpus: {message}", file=sys.stderr)


def _check_hf_ids(out: Path, splits: tuple[str, ...]) -> bool:
    if importlib.util.find_spec("tokenizers") is None:
        _log("tokenizers is not installed here: the tokenizer.json ids are not compared")
        return True
    problem = hf_id_mismatch(out, splits)
    names = " and ".join(splits)
    _log(problem or f"tokenizers and the engine give the same ids over {names}")
    return problem is None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"({DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="verify only; exit 1 if stale")
    parser.add_argument("--overrides", action="store_true", help="print the recipe overrides")
    parser.add_argument("--stdlib", type=Path, help="source folder (this Python's stdlib)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="ids with specials")
    args = parser.parse_args(argv)
    root = args.stdlib or stdlib_root()
    if not root.is_dir():
        parser.error(f"--stdlib {root}: no such folder")
    if args.vocab_size < 260:
        parser.error(f"--vocab-size {args.vocab_size}: at least 260 (256 bytes + 3 specials + 1)")
    if args.check and args.overrides:
        parser.error("--check verifies only; --overrides may build: give one")
    reasons = stale_reasons(args.out, root, args.vocab_size)
    if args.check:
        for reason in reasons:
            _log(f"stale: {reason}")
        if reasons or not _check_hf_ids(args.out, (HELDOUT, TRAIN)):
            sys.exit(1)
        _log(f"{args.out} is current")
        return
    if reasons:
        _log(f"building {args.out} from {root} ({reasons[0]})")
        start = time.perf_counter()
        try:
            manifest = build(args.out, root, args.vocab_size)
        except (OSError, ValueError) as e:
            _log(f"error: {e}")
            sys.exit(2)
        _log(
            f"{manifest['documents']['train']} + {manifest['documents']['heldout']} documents, "
            f"{manifest['tokens']['train']:,} + {manifest['tokens']['heldout']:,} tokens, "
            f"vocabulary {manifest['vocab_size']}, content_hash "
            f"{manifest['content_hash'][:12]}, {time.perf_counter() - start:.0f} s"
        )
        if not _check_hf_ids(args.out, (HELDOUT,)):  # --check compares both splits
            sys.exit(1)
    else:
        _log(f"{args.out} is current: nothing to build")
    if args.overrides:
        print(" ".join(overrides(args.out)))


if __name__ == "__main__":
    main()

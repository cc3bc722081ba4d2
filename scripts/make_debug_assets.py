"""Regenerate the shipped debug assets, byte for byte (same Python => same files).

  assets/data/debug_corpus.jsonl      templated English-like documents, {"text": ...} per line
  assets/tokenizer/debug.tiktoken     a byte-level BPE trained on that corpus (Qwen's regex),
                                      2000 ids with the 3 specials, so it fits vocab_size 2048

Usage: python scripts/make_debug_assets.py [--check]   (--check: fail if the files would change)
       python scripts/make_debug_assets.py --corpus-docs N --corpus-out PATH [--seed S]
         (a larger corpus from the same generator, for loss comparisons whose runs must not
         repeat documents: the shipped 650 documents are about 3 steps of a 4 x 4096 batch)

The corpus has regularities a tiny model learns within tens of steps: fixed templates, a small
vocabulary, copied names, counting and simple arithmetic.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from torchtitan_ablate.components.text.bpe import count_pretokens, train_bpe, write_atomically
from torchtitan_ablate.components.text.tokenizer import TIKTOKEN_SPECIALS, save_tiktoken_ranks

ROOT = Path(__file__).resolve().parents[1]
NUM_DOCS = 650
VOCAB_SIZE = 2000  # including the special tokens

NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia Peter "
    "Quinn Rosa Samuel Tara Umar Vera Walter Xenia Yusuf Zoe Arthur Beatrice Conrad Delia Edgar "
    "Fiona Gustav Hannah Ivan Julia Kevin Lena Marcus Nadia Oscar Paula Rufus Sofia Tobias Ursula"
).split()
CITIES = (
    "Paris London Berlin Madrid Rome Vienna Prague Lisbon Dublin Oslo Helsinki Athens Warsaw "
    "Budapest Zurich Geneva Munich Hamburg Milan Naples Seville Porto Krakow Bergen Tallinn Riga"
).split()
JOBS = (
    "baker teacher doctor farmer painter pilot sailor singer tailor writer lawyer nurse builder "
    "gardener librarian engineer chemist dentist plumber carpenter butcher musician"
).split()
ANIMALS = (
    "cat dog horse rabbit fox owl wolf bear mouse goat sheep duck goose swan otter badger deer "
    "eagle falcon turtle frog lizard tiger lion zebra camel donkey pigeon sparrow"
).split()
COLORS = "red blue green yellow black white brown orange purple grey pink silver golden".split()
ADJS = (
    "small large quick slow happy quiet loud old young bright dark gentle brave clever lazy "
    "hungry sleepy tiny huge calm wild friendly proud shy"
).split()
THINGS = (
    "apples books coins letters stones flowers cookies pencils candles shells marbles ribbons "
    "buttons cards keys maps plates cups spoons bottles baskets"
).split()
PLACES = (
    "garden forest river market station library kitchen harbor castle meadow bridge village "
    "bakery school museum theater tower valley"
).split()
VERBS = (
    "jumps runs walks sleeps sings hides waits plays rests dances swims climbs reads writes "
    "cooks paints"
).split()
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = (
    "January February March April May June July August September October November December"
).split()


# Invented surnames from syllables give the BPE sub-word structure to learn (and the corpus enough
# distinct words to reach the vocabulary size); each document repeats its surname, so copying pays.
ONSETS = "b br c ch d f g gr h k l m n p r s st t th v w".split()
VOWELS = "a e i o u ai ea oo".split()
CODAS = "n r l s th ck m nd rt ll".split()
ENDINGS = "ton wick ham ford by field worth ley more dale".split()


def make_surnames(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        parts = [rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)]
        parts += [rng.choice(VOWELS) + rng.choice(CODAS)] if rng.random() < 0.4 else []
        names.add(("".join(parts) + rng.choice(ENDINGS)).capitalize())
    return sorted(names)


def make_document(rng: random.Random, surnames: list[str]) -> str:
    """A short story: a person, a city, a job, then several templated facts about them."""
    name, friend = rng.sample(NAMES, 2)
    surname, city, job = rng.choice(surnames), rng.choice(CITIES), rng.choice(JOBS)
    article = "an" if job[0] in "aeiou" else "a"
    sentences = [f"{name} {surname} lives in {city} and works as {article} {job}."]
    for _ in range(rng.randint(3, 7)):
        kind = rng.randrange(8)
        if kind == 0:
            a, b = rng.randint(2, 12), rng.randint(1, 9)
            thing = rng.choice(THINGS)
            sentences.append(
                f"{name} has {a} {thing}. {friend} gives {name} {b} more. "
                f"Now {name} has {a + b} {thing}."
            )
        elif kind == 1:
            animal, adj, color = rng.choice(ANIMALS), rng.choice(ADJS), rng.choice(COLORS)
            sentences.append(
                f"The {adj} {color} {animal} {rng.choice(VERBS)} near the {rng.choice(PLACES)}."
            )
        elif kind == 2:
            start = rng.randrange(len(NUMBERS) - 4)
            sentences.append("We count: " + ", ".join(NUMBERS[start : start + 5]) + ".")
        elif kind == 3:
            d = rng.randrange(7)
            sentences.append(f"After {DAYS[d]} comes {DAYS[(d + 1) % 7]}.")
        elif kind == 4:
            m = rng.randrange(12)
            sentences.append(f"In {MONTHS[m]}, {name} visits {friend} in {rng.choice(CITIES)}.")
        elif kind == 5:
            sentences.append(f"Every morning the {job} goes to the {rng.choice(PLACES)}.")
        elif kind == 6:
            sentences.append(f"The {job} is called {name} {surname}.")
        else:
            sentences.append(f"{friend} asks {name}: where do you live? {name} says: in {city}.")
    return " ".join(sentences)


def make_corpus(num_docs: int = NUM_DOCS, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    surnames = make_surnames(rng, 600)
    return [make_document(rng, surnames) for _ in range(num_docs)]


def write_corpus(corpus: list[str], path: Path) -> None:
    text = "".join(json.dumps({"text": t}) + "\n" for t in corpus)
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="ascii"))


def write_assets(root: Path) -> list[Path]:
    corpus = make_corpus()
    data = root / "assets" / "data" / "debug_corpus.jsonl"
    tok = root / "assets" / "tokenizer" / "debug.tiktoken"
    write_corpus(corpus, data)
    ranks = train_bpe(count_pretokens(corpus), VOCAB_SIZE - len(TIKTOKEN_SPECIALS))
    write_atomically(tok, lambda tmp: save_tiktoken_ranks(ranks, tmp))
    return [data, tok]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files")
    parser.add_argument("--corpus-docs", type=int, help="write a corpus of this many documents")
    parser.add_argument("--corpus-out", type=Path, help="where --corpus-docs writes (jsonl)")
    parser.add_argument("--seed", type=int, help="generator seed for --corpus-docs (1234)")
    args = parser.parse_args(argv)
    if (args.corpus_docs is None) != (args.corpus_out is None):
        parser.error("--corpus-docs and --corpus-out go together")
    if args.seed is not None and args.corpus_docs is None:
        parser.error("--seed applies to --corpus-docs only (the shipped assets have a fixed seed)")
    if args.corpus_docs is not None:
        if args.corpus_docs < 1:
            parser.error(f"--corpus-docs {args.corpus_docs}: give a positive number of documents")
        seed = 1234 if args.seed is None else args.seed
        try:
            write_corpus(make_corpus(args.corpus_docs, seed), args.corpus_out)
        except OSError as e:
            problem = e.strerror or e
            print(f"--corpus-out {args.corpus_out}: cannot write: {problem}", file=sys.stderr)
            sys.exit(2)
        print(f"wrote {args.corpus_out} ({args.corpus_docs} documents)")
        return
    if not args.check:
        for path in write_assets(ROOT):
            print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        stale = [
            p.relative_to(tmp)
            for p in write_assets(Path(tmp))
            if p.read_bytes() != (ROOT / p.relative_to(tmp)).read_bytes()
        ]
    if stale:
        sys.exit(f"stale assets (rerun scripts/make_debug_assets.py): {stale}")
    print("assets up to date")


if __name__ == "__main__":
    main()

"""The README, docs/ and the code's comments describe the engine, not the work that built it.

Pages (README.md, docs/**/*.md) are for users: none tells the history of the work (sessions,
stages, issues, HEAD, reverted changes, device calls) or names the developers' log, every
relative link resolves to a file inside the repository, and every repository path a page names
exists. The comments and docstrings of the package, scripts/ and estimation.py and the TOML
comments of train_configs/ keep the same words out and cite no file the repository lacks.
"""

import ast
import fnmatch
import io
import os
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

from tests.helpers.doc_commands import comment_start

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
# Linked from the pages: its links and paths must resolve too, though it records runs, not docs.
LINKED = [*PAGES, ROOT / "results" / "ablations" / "README.md"]
# The reviewers' words (shared hooks/before-stop) and the log's name, in every page and comment.
WORK_WORDS = re.compile(
    r"(?i:\bsessions?\b|device tool|\bstage [a-z]\b|\breverted\b|\b(?:first|next|another) call\b"
    r"|\bLOG\.md\b|\bDESIGN\.md\b)|\bHEAD\b"
)
# Pages also avoid the nouns of a work plan; in code "issue" and "stage" are ordinary verbs.
PAGE_WORDS = re.compile(r"\b(session|stage|issue)s?\b", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
# A repository path (from the root, or a package path such as models/common/permute.py) or, on
# the pages, a bare file name; placeholders (OUT, STUDY, <study>, *) are left alone.
REPO_PATH = re.compile(
    r"(?<![\w./*-])(?:(?P<path>(?:torchtitan_ablate|scripts|train_configs|tests|assets|docs|results"
    r"|dev)/[\w./-]*|(?:models|distributed|components|estimator|config|ablate)/[\w/]+\.py)"
    r"|(?P<bare>\w+\.(?:py|sh|toml|md))\b)"
)
# All-caps names are placeholders (OUT, STUDY.toml, A.toml), except these conventional file names.
REAL_CAPS = {"README", "LOG", "DESIGN", "LICENSE", "CHANGELOG"}

# Files other engineers are rewriting now: their comments are checked once they land.
# Empty this list then; test_pending_rewrite_names_existing_files keeps it honest meanwhile.
PENDING_REWRITE = [
    "torchtitan_ablate/models/common/moe.py",
]
CODE = sorted(
    [
        *(ROOT / "torchtitan_ablate").rglob("*.py"),
        *(p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh", ".sbatch")),
        ROOT / "estimation.py",
        ROOT / "run_train.sh",
        *(ROOT / "train_configs").rglob("*.toml"),
    ]
)


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _pending(path: Path) -> bool:
    return any(fnmatch.fnmatch(_id(path), pattern) for pattern in PENDING_REWRITE)


def python_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string statement (docstrings, field docs)."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                lines = node.value.value.splitlines()
                found += [(node.lineno + i, line) for i, line in enumerate(lines)]
    return found


def hash_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every `#` comment of a TOML or shell file (a `#` inside quotes is not)."""
    found = []
    for n, line in enumerate(source.splitlines(), 1):
        start = comment_start(line, shell=False)
        if start is not None:
            found.append((n, line[start:]))
    return found


def comments(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    return python_comments(source) if path.suffix == ".py" else hash_comments(source)


@cache
def _file_names() -> frozenset[str]:
    names = set()
    for _, dirs, files in os.walk(ROOT):  # symlinks (the .venv) are not followed
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "outputs"]
        names.update(files)
    return frozenset(names)


def _placeholder(path: str) -> bool:
    stems = [part.split(".")[0] for part in path.split("/")]
    return any(
        "<" in stem or "*" in stem or (stem.isupper() and stem not in REAL_CAPS) for stem in stems
    )


def missing_paths(text: str, bare: bool = True) -> list[str]:
    """The repository paths `text` names that do not exist (a package path may omit
    torchtitan_ablate/); with `bare`, also file names found nowhere in the repository."""
    bad = []
    for m in REPO_PATH.finditer(text):
        if m["bare"]:
            if bare and not _placeholder(m["bare"]) and m["bare"] not in _file_names():
                bad.append(m["bare"])
            continue
        path = m["path"].rstrip("./-")
        if _placeholder(path):
            continue
        if text[m.end() : m.end() + 1] in ("{", "<", "*"):  # a template: only its folder is real
            path = path.rsplit("/", 1)[0]
        if not any((base / path).exists() for base in (ROOT, ROOT / "torchtitan_ablate")):
            bad.append(path)
    return bad


def _hits(pattern: re.Pattern, lines: list[tuple[int, str]], path: Path) -> list[str]:
    return [f"{_id(path)}:{n}: {text.strip()}" for n, text in lines if pattern.search(text)]


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_pages_tell_no_history_of_the_work(page):
    lines = list(enumerate(page.read_text().splitlines(), 1))
    hits = _hits(WORK_WORDS, lines, page) + _hits(PAGE_WORDS, lines, page)
    assert hits == [], "pages describe the engine; history belongs in dev/:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", [p for p in CODE if not _pending(p)], ids=_id)
def test_comments_state_facts_not_history(path):
    hits = _hits(WORK_WORDS, comments(path), path)
    assert hits == [], "comments say why in the present tense:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", [p for p in CODE if not _pending(p)], ids=_id)
def test_comments_cite_existing_files(path):
    # Bare names are left out: comments also name other packages' files (liger's cce.py).
    found = [(n, p) for n, text in comments(path) for p in missing_paths(text, bare=False)]
    bad = [f"{_id(path)}:{n}: {p}" for n, p in found]
    assert bad == [], "comments name files the repository lacks:\n" + "\n".join(bad)


def test_pending_rewrite_names_existing_files():
    stale = [p for p in PENDING_REWRITE if not any(fnmatch.fnmatch(_id(f), p) for f in CODE)]
    assert stale == [], f"PENDING_REWRITE entries that match no file: {stale}"


@pytest.mark.parametrize("page", LINKED, ids=_id)
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        path = target.split("#")[0]
        resolved = (page.parent / path).resolve()
        if path.startswith("/") or not resolved.is_relative_to(ROOT) or not resolved.exists():
            bad.append(target)
    assert bad == [], f"{_id(page)}: links that do not resolve in the repo: {bad}"


@pytest.mark.parametrize("page", LINKED, ids=_id)
def test_named_paths_exist(page):
    lines = enumerate(page.read_text().splitlines(), 1)
    bad = [f"{_id(page)}:{n}: {p}" for n, text in lines for p in missing_paths(text)]
    assert bad == [], "paths named in the page that the repository lacks:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_pages_link_no_log(page):
    logs = [t for t in LINK.findall(page.read_text()) if re.search(r"(?i)(^|/)(dev/|log\b)", t)]
    assert logs == [], f"{_id(page)} links the developers' log: {logs}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_no_pointer_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "shared/DESIGN" not in text


def test_the_checks_catch_what_they_are_for():
    # The words and paths the tests above exist to catch, each caught.
    for text in ("the HEAD tree", "a reverted change", "in the next call", "the sessions' log",
                 "see LOG.md", "stage b", "see DESIGN.md"):  # fmt: skip
        assert WORK_WORDS.search(text), text
    for text in (
        "head-tail chunks",
        "the output head",
        "issues an all-gather",
        "the first CUDA call",
    ):
        assert not WORK_WORDS.search(text), text
    assert missing_paths("docs/ablations/ep_vs_no_ep and models/common/nothing.py") == [
        "docs/ablations/ep_vs_no_ep",
        "models/common/nothing.py",
    ]
    assert missing_paths("results/ablations/STUDY, models/common/permute.py, run_train.sh") == []
    assert missing_paths("see no_such_file.py, docs/LOG.md") == ["no_such_file.py", "docs/LOG.md"]
    code = '"""Doc."""\nx = 1  # a comment\n"""Field doc."""\ns = "# not a comment"\n'
    assert [t for _, t in python_comments(code)] == ["# a comment", "Doc.", "Field doc."]
    assert hash_comments('a = "#x"  # why\n# line\n') == [(1, "# why"), (2, "# line")]

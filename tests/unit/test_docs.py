"""docs/ is user documentation plus docs/LOG.md: no page but the log tells the history of the work
(sessions, stages, issues), and every relative link of the README and the docs resolves to a
file inside the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
HISTORY_WORDS = re.compile(r"\b(session|stage|issue)s?\b", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in DOCS if p.name != "LOG.md"], ids=_id)
def test_no_work_history_words(page):
    hits = [
        f"{page.name}:{n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if HISTORY_WORDS.search(line)
    ]
    assert hits == [], "history belongs in docs/LOG.md:\n" + "\n".join(hits)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        path = target.split("#")[0]
        resolved = (page.parent / path).resolve()
        if path.startswith("/") or not resolved.is_relative_to(ROOT) or not resolved.exists():
            bad.append(target)
    assert bad == [], f"{page.relative_to(ROOT)}: links that do not resolve in the repo: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_no_pointer_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "shared/DESIGN" not in text

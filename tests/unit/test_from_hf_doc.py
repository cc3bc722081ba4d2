"""docs/from_hf.md maps HF Trainer / TRL / axolotl names to this engine's keys: every
`section.key` it names is a key of the config, and every row says what to set or that there is
no equivalent."""

import dataclasses
import re
from pathlib import Path

from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.config.loader import field_types

PAGE = Path(__file__).resolve().parents[2] / "docs" / "from_hf.md"
SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig)}
KEY = re.compile(r"`(" + "|".join(SECTIONS) + r")\.(\w+)")
FILES = {"jsonl", "toml"}  # metrics.jsonl, config.toml: file names, not keys


def test_every_key_named_exists():
    text = PAGE.read_text()
    named = KEY.findall(text)
    assert len(named) > 60  # the table, not a stray mention
    keys = {(s, k) for s, k in named if k not in FILES}
    missing = sorted(f"{s}.{k}" for s, k in keys if k not in field_types(SECTIONS[s]))
    assert not missing


def test_every_row_maps_to_a_key_or_says_there_is_none():
    names = PAGE.read_text().split("## Argument names")[1].split("\n## ")[0]
    table = [x for x in names.splitlines() if x.startswith("| ") and not x.startswith("| HF")]
    assert len(table) > 50
    for row in table:
        ours = row.split("|")[3]
        assert KEY.search(ours) or any(w in ours for w in ("no equivalent", "no key", "always"))

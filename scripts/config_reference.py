"""Writes docs/config_reference.md from the JobConfig field docstrings."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_ablate.config.reference import render_markdown  # noqa: E402

if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/config_reference.md"
    with open(path, "w") as f:
        f.write(render_markdown() + "\n")
    print(f"wrote {path}")

"""Write docs/config_reference.md (every config key with its type, default and meaning) from the
JobConfig field docstrings.

    python scripts/config_reference.py [OUT.md]

Run it after changing a field of torchtitan_ablate/config/job_config.py; a test fails while the
shipped page is out of date.
"""

import argparse

from torchtitan_ablate.config.reference import render_markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", default="docs/config_reference.md", help="output file")
    args = parser.parse_args(argv)
    with open(args.out, "w") as f:
        f.write(render_markdown() + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

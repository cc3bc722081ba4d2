"""Run an ablation: `python scripts/ablate.py ABLATION.toml [options]`, the same command as the
installed `ttablate-ablate` (torchtitan_ablate/ablate/cli.py; --help lists the options)."""

import sys

from torchtitan_ablate.ablate import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, prog="python scripts/ablate.py")


if __name__ == "__main__":
    sys.exit(main())

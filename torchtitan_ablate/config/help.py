"""`--help` for the entry points: every section and key of JobConfig with its type, default and
meaning, from the same docstrings as docs/config_reference.md. Imports no torch, so it answers
in well under a second (the trainer's imports take seconds).

    python -m torchtitan_ablate.config.help [SECTION]     # what `./run_train.sh --help` runs
"""

import sys
import textwrap

from torchtitan_ablate.config.reference import config_keys

USAGE = """usage: {prog} [--job.config_file FILE.toml] [--section.key value ...]

Settings: defaults < TOML file (--job.config_file) < command line (--section.key value or
--section.key=value; booleans true/false, a bare --section.flag means true). A bad key, value or
file is one line on stderr and exit code 2. `--help SECTION` shows one section.
"""


def help_text(prog: str, section: str | None = None) -> str:
    """The usage line and the keys of every section (or of `section` only)."""
    keys = dict(config_keys())
    if section is not None and section not in keys:
        raise ValueError(f"no section [{section}]: one of {', '.join(keys)}")
    out = [USAGE.format(prog=prog)]
    for name, rows in keys.items():
        if section is not None and name != section:
            continue
        out.append(f"[{name}]")
        for key, described, shown, doc in rows:
            out.append(f"  --{name}.{key}  ({described}, default {shown})")
            out += textwrap.wrap(doc, 96, initial_indent="      ", subsequent_indent="      ")
        out.append("")
    return "\n".join(out)


def exit_if_help(argv: list[str], prog: str) -> None:
    """Prints the help and exits 0 when argv asks for it (-h / --help [SECTION])."""
    for i, arg in enumerate(argv):
        if arg in ("-h", "--help"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            section = nxt if nxt is not None and not nxt.startswith("-") else None
            try:
                print(help_text(prog, section))
            except ValueError as e:
                print(f"config error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
            raise SystemExit(0)


if __name__ == "__main__":
    args = sys.argv[1:]
    exit_if_help(args if {"-h", "--help"} & set(args) else ["--help", *args], "./run_train.sh")

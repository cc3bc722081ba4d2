"""`--help` for the entry points: every section and key of JobConfig with its type, default and
meaning, from the same docstrings as docs/config_reference.md, and the launcher's environment
variables. Imports no torch, so it answers in well under a second (the trainer's imports take
seconds).

    python -m torchtitan_ablate.config.help [SECTION]     # what `./run_train.sh --help` runs
"""

import sys
import textwrap

from torchtitan_ablate.config.reference import config_keys

USAGE = """usage: {prog} [--job.config_file FILE.toml] [--section.key value ...]

Settings: defaults < TOML file (--job.config_file) < command line (--section.key value or
--section.key=value; booleans true/false, a bare --section.flag means true). A bad key, value or
file is one line on stderr and exit code 2. `--help SECTION` shows one section;
`--help environment` the launcher's environment variables (also listed at the end).
"""

# What run_train.sh and scripts/setup_env.sh read (tests/unit/config/test_help.py checks that
# every variable they read is here).
ENVIRONMENT = """\
Environment variables of ./run_train.sh (python -m torchtitan_ablate.train is one process and
reads none of them):
  CONFIG_FILE  the TOML recipe (default train_configs/debug_model.toml); a --job.config_file on
               the command line wins
  NGPU         processes per node (default: the visible GPUs, else 1; on CPU, gloo processes);
               above 1, or with NNODES above 1, the run goes through torchrun
  NNODES, NODE_RANK  the number of nodes and this node's index (default 1 and 0)
  MASTER_ADDR, MASTER_PORT  torchrun's rendezvous (default: one node takes a free port; several
               nodes localhost:29500)
  LOG_RANK     the local ranks whose output the terminal shows, comma-separated (default 0); the
               one-line error of a hidden rank still shows
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun gives its workers to stop and save after a
               SIGTERM or Ctrl-C before it kills them (default 300)
  PYTHON       the interpreter (default: the activated VIRTUAL_ENV's, else .venv's, else
               python3, if it imports the dependencies; else .venv is created)
  FORCE_VENV   set: use (or create) .venv even when the activated environment or python3 works
  EXTRAS, TORCH_INDEX_URL, TORCH_VERSION  when .venv is created: EXTRAS=dev adds the test tools;
               torch's package index and version (default 2.13.0)
"""


def help_text(prog: str, section: str | None = None, launcher: bool = True) -> str:
    """The usage line and the keys of every section (or of `section` only); launcher: the
    trainer's entry points, whose full help ends with run_train.sh's environment variables."""
    keys = dict(config_keys())
    if section == "environment":
        return ENVIRONMENT
    if section is not None and section not in keys:
        raise ValueError(f"no section [{section}]: one of {', '.join(keys)}, or environment")
    out = [USAGE.format(prog=prog)]
    for name, rows in keys.items():
        if section is not None and name != section:
            continue
        out.append(f"[{name}]")
        for key, described, shown, doc in rows:
            out.append(f"  --{name}.{key}  ({described}, default {shown})")
            out += textwrap.wrap(doc, 96, initial_indent="      ", subsequent_indent="      ")
        out.append("")
    if section is None and launcher:
        out.append(ENVIRONMENT)
    return "\n".join(out)


def exit_if_help(argv: list[str], prog: str, launcher: bool = True) -> None:
    """Prints the help and exits 0 when argv asks for it (-h / --help [SECTION])."""
    for i, arg in enumerate(argv):
        if arg in ("-h", "--help"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            section = nxt if nxt is not None and not nxt.startswith("-") else None
            try:
                print(help_text(prog, section, launcher))
            except ValueError as e:
                print(f"config error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
            raise SystemExit(0)


if __name__ == "__main__":
    args = sys.argv[1:]
    exit_if_help(args if {"-h", "--help"} & set(args) else ["--help", *args], "./run_train.sh")

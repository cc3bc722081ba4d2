"""Which checkout an ablation runs: the one it is launched from.

An editable install (pip install -e .) points its environment at one clone, so a second clone's
`python scripts/ablate.py` (or `ttablate-ablate` typed inside it) would plan, run and report with
the first clone's code, recipes, run_train.sh and outputs/ folder. The launching checkout is
scripts/ablate.py's own, else the one holding the current directory; when it is another than the
one this package was imported from, the command runs again in a new process on its code (first
on PYTHONPATH, which its run_train.sh keeps for the runs).
"""

import os
import sys
from pathlib import Path

from torchtitan_ablate.ablate.environment import ROOT

AGAIN = "TTABLATE_CHECKOUT"  # set for the new process: it never runs the command a third time


def is_checkout(folder: Path) -> bool:
    return (folder / "run_train.sh").is_file() and (folder / "torchtitan_ablate").is_dir()


def launching_checkout(script: str, cwd: Path) -> Path | None:
    """The checkout of `script` when it is a checkout's scripts/ablate.py, else the checkout
    holding cwd; None outside any checkout."""
    path = Path(script).resolve()
    if path.name == "ablate.py" and path.parent.name == "scripts" and is_checkout(path.parents[1]):
        return path.parents[1]
    cwd = cwd.resolve()
    return next((f for f in (cwd, *cwd.parents) if is_checkout(f)), None)


def run_in_launching_checkout(argv: list[str], prog: str) -> None:
    """Replaces this process by the same command on the launching checkout's code when that is
    not ROOT (the one imported); returns otherwise."""
    here = launching_checkout(sys.argv[0], Path.cwd())
    if here is None or here == ROOT or os.environ.get(AGAIN):
        return
    env = dict(os.environ, **{AGAIN: str(here)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))
    # The checkout goes first on sys.path too: `python -c` puts the current directory ahead of
    # PYTHONPATH, and that may be inside yet another clone.
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r}); "
        "from torchtitan_ablate.ablate.cli import main; sys.exit(main(sys.argv[2:], sys.argv[1]))"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-c", code, prog, *argv], env)

r"""Where a relative path written in a TOML recipe points, and how a command line gives a list
of paths.

A recipe names its inputs relative to where it lives, so it must work from any directory. The
shipped recipes (train_configs/*.toml) name them relative to the repository root instead
("assets/tokenizer/debug.tiktoken"), so one rule serves both: a relative path value read from a
TOML file is looked up in the TOML's folder, then in each folder above it, and the first folder
holding it wins; found nowhere, it stays relative to the current directory (a checkpoint that
does not exist yet, or a typo the loader reports later with its key).

Only the input paths below are resolved. Command-line values stay relative to the current
directory, as a shell user expects. job.dump_folder is an output and stays relative to the
current directory too (torchtitan's `./outputs` is where the user launched, not where the recipe
lives); the folders inside it (checkpoint.folder, metrics.save_tb_folder) are relative to it.

A data mixture (training.dataset_path, a list in TOML) is given on the command line as its paths
separated by commas: `--training.dataset_path web.jsonl,code.parquet`, with the weights as
`--training.dataset_weights 0.7,0.3`; ablation variants pass TOML lists that way. A comma inside a
path is written `\,` (`--training.dataset_path 'odd\,name.jsonl'`); an unescaped one in the name
of a path that exists, while the pieces do not, is refused with that hint.
"""

import os
import re

PATH_KEYS = frozenset(
    {
        "model.tokenizer_path",
        "training.dataset_path",
        "validation.dataset_path",
        "checkpoint.initial_load_path",
    }
)
NOT_PATHS = frozenset({"byte"})  # model.tokenizer_path's built-in byte-level tokenizer
# Keys whose command-line value is a comma-separated list of paths (one path stays a string).
PATH_LIST_KEYS = frozenset({"training.dataset_path"})
_SEPARATOR = re.compile(r"(?<!\\),")  # a comma not written as \,


def split_paths(key: str, value: str) -> str | list[str]:
    """A command-line value of a PATH_LIST_KEYS key: one path (a string), or several (a list)
    separated by commas; `\\,` is a comma inside a path, empty pieces are dropped. ValueError
    when an unescaped comma splits the name of a path that exists into pieces that do not."""
    pieces = [p.replace("\\,", ",") for p in _SEPARATOR.split(value)]
    if len(pieces) == 1:
        return pieces[0]
    paths = [p for p in pieces if p]
    whole = value.replace("\\,", ",")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing and os.path.exists(whole):
        raise ValueError(
            f"{key} = '{value}': commas separate the paths of a data mixture, and "
            f"'{missing[0]}' does not exist while '{whole}' does: write its commas as \\, "
            f"(--{key} '{escape_commas(whole)}')"
        )
    return paths if len(paths) > 1 else (paths[0] if paths else "")


def escape_commas(path: str) -> str:
    """`path` as one item of a comma-separated command-line list (split_paths reads it back)."""
    return path.replace(",", "\\,")


def resolve_toml_path(value: str, toml_file: str) -> str:
    """value (a relative path read from toml_file) as a path that works from the current
    directory: relative to it when the file lies below it, so a run launched from the repository
    root records the recipe's own spelling, else absolute."""
    if not value or os.path.isabs(value) or value in NOT_PATHS:
        return value
    folder = os.path.dirname(os.path.abspath(toml_file))
    while True:
        candidate = os.path.join(folder, value)
        if os.path.exists(candidate):
            break
        parent = os.path.dirname(folder)
        if parent == folder:  # the filesystem root: found nowhere
            return value
        folder = parent
    candidate = os.path.normpath(candidate)
    cwd = os.getcwd()
    if os.path.commonpath([cwd, candidate]) == cwd:
        return os.path.relpath(candidate, cwd)
    return candidate

"""Where a relative path written in a TOML recipe points.

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
"""

import os

PATH_KEYS = frozenset(
    {
        "model.tokenizer_path",
        "training.dataset_path",
        "validation.dataset_path",
        "checkpoint.initial_load_path",
    }
)
NOT_PATHS = frozenset({"byte"})  # model.tokenizer_path's built-in byte-level tokenizer


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

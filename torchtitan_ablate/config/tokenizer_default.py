"""model.tokenizer_path when a run starts from Hugging Face weights and neither the recipe nor the
command line names a tokenizer: the HF folder's own. The default, the debug tokenizer, would pair
the weights with another vocabulary and train garbage, so a folder without a tokenizer is refused.
"""

import os

from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.config.job_config import JobConfig

KEY = "model.tokenizer_path"


def holds_tokenizer(folder: str) -> bool:
    """Whether the folder holds a file that build_tokenizer reads from a folder."""
    return any(
        name in ("tokenizer.json", "tokenizer.model") or name.endswith(".tiktoken")
        for name in os.listdir(folder)
    )


def default_tokenizer(config: JobConfig, named: set[str]) -> None:
    """model.tokenizer_path = checkpoint.initial_load_path when that is an HF folder and `named`
    (the "section.key" names that the recipe or the command line set) lacks model.tokenizer_path;
    ConfigError when the folder holds no tokenizer."""
    ck = config.checkpoint
    folder = ck.initial_load_path
    if KEY in named or ck.initial_load_format != "hf" or not folder or not os.path.isdir(folder):
        return  # (a missing folder is the weights loader's error)
    if not holds_tokenizer(folder):
        raise ConfigError(
            f"checkpoint.initial_load_path = {folder!r} holds no tokenizer (tokenizer.json, "
            f"tokenizer.model or *.tiktoken) and {KEY} is not set: name the weights' tokenizer "
            f"with --{KEY} (the default, {config.model.tokenizer_path!r}, is not theirs)"
        )
    config.model.tokenizer_path = folder

"""An HF folder's config.json, read with one clear error per way it can be missing or broken."""

import json
import os
from pathlib import Path
from typing import Any


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The config.json of an HF folder (or of a DCP folder written by convert_checkpoint)."""
    config = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise ValueError(f"{path}: no such folder (expected one holding config.json)")
    if not config.is_file():
        raise ValueError(f"{path} holds no config.json (needed for HF weights / flavor 'auto')")
    try:
        data = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config} holds a JSON {type(data).__name__}, not an object")
    return data

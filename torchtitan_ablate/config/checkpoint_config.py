"""The [checkpoint] section: what a run saves and loads. Field docstrings are the reference
text, as in job_config.py."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints and resume from the latest one."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""

    interval: int = 500
    """Save every this many steps (and at the last step)."""

    keep_latest_k: int = 3
    """Keep this many checkpoints, the one just saved included (0 = all); older steps are
    deleted after each save."""

    load_step: int = -1
    """Step to resume from; -1 = the latest complete one. Resuming an older step moves the newer
    ones into <checkpoint folder>/abandoned/<time>/ (never deleted, never loaded again)."""

    initial_load_path: str | None = None
    """Weights to start from when the folder has no checkpoint yet (a DCP folder, or an HF
    folder with config.json and *.safetensors when initial_load_format = "hf")."""

    initial_load_format: Literal["dcp", "hf"] = "dcp"
    """Format of initial_load_path: dcp (model-only or full DCP checkpoint) or hf (Hugging Face
    Qwen3 / Qwen3-MoE safetensors, read shard by shard straight into the sharded model)."""

    last_save_in_hf: bool = False
    """Also write the checkpoint of the run's last step (training.steps) in Hugging Face format,
    into <folder>/step-<N>/hf: config.json + model.safetensors, LoRA adapters merged, as
    scripts/convert_checkpoint.py --to hf writes it (torchtitan's key; the DCP checkpoint is kept
    for resuming). Rank 0 reads the whole model into CPU memory for it. Needs enable = true."""

    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    """dtype of the weights last_save_in_hf writes (torchtitan's key)."""

    create_seed_checkpoint: bool = False
    """Build the model in one process (NGPU=1, degrees 1; needs enable = true), write its initial
    weights to <folder>/step-0 and exit; every layout then starts from them through
    initial_load_path (or by resuming in this dump folder)."""

"""Configs the estimator tests share: the debug models at a small size and each shipped
recipe's intended world size (its header comment)."""

from torchtitan_ablate.config import load_config

SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
DENSE = ["--job.config_file", "train_configs/debug_model.toml", *SMALL]
MOE = ["--job.config_file", "train_configs/qwen3_moe_debug.toml", *SMALL]

INTENDED_WORLD_SIZE = {
    **dict.fromkeys(
        ["debug_model", "qwen3_moe_debug", "qwen3_0.6b", "qwen3_0.6b_sft", "qwen3_1.7b"], 1
    ),
    **dict.fromkeys(["qwen3_moe_1gpu", "qwen3_4b_float8"], 1),
    **dict.fromkeys(["qwen3_0.6b_dpo", "qwen3_moe_lora_dpo", "debug_sft", "debug_dpo"], 1),
    **dict.fromkeys(["qwen3_1.7b_zero2", "qwen3_8b_fsdp", "qwen3_8b_cp", "qwen3_moe_ep"], 8),
    "qwen3_30b_a3b_lora_ep": 8,
    "qwen3_moe_ep4": 4,
    **dict.fromkeys(["qwen3_8b_hsdp", "qwen3_30b_a3b"], 16),  # 2 nodes x 8 GPUs
}


def _config(base: list[str], world_size: int, *extra: str):
    return load_config([*base, "--memory_estimation.world_size", str(world_size), *extra])

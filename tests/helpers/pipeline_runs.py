"""Train configs in turn on every rank with the debug models (dense and MoE) untied and
narrowed, for the pipeline-parallel equivalence tests (PP refuses tied embeddings).

Narrowed to dim 64: a broken schedule's gradients or updates still move the weights far past
1e-4, in a third of the time. Patched inside the rank function: ranks are forked processes, so
the patch stays in them.
"""

import os
import shutil
from dataclasses import replace

import torch.distributed as dist

from tests.helpers.parallel_harness import train_layout
from torchtitan_ablate.models.qwen3 import qwen3_flavors

STEP1 = os.path.join("checkpoint", "step-1")
Case = tuple[str, list[str], str | None]  # name, args, the run whose step-1 checkpoint it loads
# Three steps of 8 sequences of 32 tokens, 4 blocks.
NARROW_ARGS = ["--training.steps", "3", "--training.seq_len", "32", "--model.n_layers", "4"]
# Validation after every step (under PP the schedule's eval between its training steps) on the
# same global rows at any dp degree; assert_same_training compares the figures.
VAL = ["--validation.enable", "true", "--validation.dataset_path", "assets/data/debug_corpus.jsonl"]
VAL += ["--validation.freq", "1", "--validation.steps", "2", "--training.data_sharding", "rows"]


def pp2_with(degree: str) -> list[str]:
    """PP 2 x `degree` 2 (a parallelism key), in micro-batches of 2 sequences."""
    p = "--parallelism."
    return [p + "pipeline_parallel_degree", "2", p + degree, "2"] + [
        p + "pipeline_parallel_microbatch_size",
        "2",
    ]


def train_narrow_cases(root: str, cases: list[Case]) -> dict:
    """On every rank: each case in turn, in root/<name>; a case that resumes starts from a copy
    of that run's step-1 checkpoint (a copy: the resumed run prunes its own folder)."""
    narrow = dict(tie_embeddings=False, dim=64, n_heads=4, n_kv_heads=2, head_dim=16)
    narrow["hidden_dim"] = 128
    flavors = qwen3_flavors
    flavors["debugmodel"] = replace(flavors["debugmodel"], **narrow)
    flavors["debugmodel_moe"] = replace(flavors["debugmodel_moe"], moe_hidden_dim=32, **narrow)
    out = {}
    for name, args, resumes in cases:
        folder = os.path.join(root, name)
        if resumes is not None and dist.get_rank() == 0:
            shutil.copytree(os.path.join(root, resumes, STEP1), os.path.join(folder, STEP1))
        dist.barrier()
        out[name] = train_layout(folder, args)
    return out

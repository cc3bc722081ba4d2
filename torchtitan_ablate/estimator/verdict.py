"""The estimate as a table, a verdict with the cheapest knobs that would fit (advice.py picks
them), and JSON."""

import json
import os

from torchtitan_ablate.config import JobConfig
from torchtitan_ablate.config.derived import resolved_reshard_after_forward
from torchtitan_ablate.config.pipeline_rules import SPLIT_BACKWARD
from torchtitan_ablate.layout import build_parallel_dims

LABELS = {
    "parameters": "parameters (sharded)",
    "buffers": "buffers",
    "optimizer_states": "optimizer states",
    "unsharded_parameters": "parameters (all-gathered)",
    "gradients": "gradients",
    "activations": "activations",
    "temporaries": "temporaries",
    "communication": "communication buffers",
    "inputs": "inputs",
}


def device_memory_gib(config: JobConfig) -> float:
    """memory_estimation.device_memory_gib, else the visible GPU's, else 80."""
    g = config.memory_estimation.device_memory_gib
    if g > 0:
        return g
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 1024**3
    return 80.0


def required_gib(est: dict) -> float:
    return est["peak_gib"] + est["context_gib"]


FEWEST_HINT = (
    "--memory_estimation.fewest_gpus true finds the fewest GPUs that fit and the fastest "
    "layout there in one command"
)
# Reserved over active peak memory that PyTorch's caching allocator needs (expandable
# segments, as the trainer sets): dense steps, and MoE steps on one rank's experts, reuse
# blocks of the same sizes every step; under expert parallel the buffers' sizes follow how
# many rows each rank receives, so freed blocks fit the next request less often. Measured
# (active / reserved GiB): one-GPU MoE 70.9 / 72.4 and 69.8 / 71.2 (1x H200); EP 4 recipe
# 67.1 / 76.3, 48.8 / 55.6 and 60.7 / 67.8 (4x H200, docs/performance.md).
ALLOCATOR_FACTOR = {False: 1.03, True: 1.15}  # keyed by expert parallel
# Above this share of the card reserved, the allocator frees and retries inside steps: the EP 4
# recipe at 96% reserved ran 20-35% slower than with one sequence less per GPU (4x H100).
MAX_RESERVED_SHARE = 0.92


def reserved_gib(est: dict) -> float:
    """The memory the caching allocator reserves for the step (ALLOCATOR_FACTOR)."""
    return required_gib(est) * ALLOCATOR_FACTOR[bool(est.get("expert_parallel"))]


def leaves_room(est: dict, device_gib: float) -> bool:
    """The step's reserved memory stays under MAX_RESERVED_SHARE of the card: no allocator
    retries inside steps."""
    return reserved_gib(est) <= MAX_RESERVED_SHARE * device_gib


def verdict(est: dict, device_gib: float) -> tuple[bool, str]:
    """(fits, one line). Fits means the predicted peak fits; the line also warns when it leaves
    less room than the allocator needs, where the run still starts but runs slower."""
    need = required_gib(est)
    if need > device_gib:
        return False, f"does not fit in {device_gib:g} GiB (needs {need:.1f} GiB)"
    headroom = 100 * (1 - need / device_gib)
    line = f"fits in {device_gib:g} GiB with {headroom:.0f}% headroom"
    reserved = reserved_gib(est)
    if not leaves_room(est, device_gib):
        kind = "an expert-parallel step" if est.get("expert_parallel") else "a step"
        line += (
            f", but the allocator needs about {reserved:.0f} GiB reserved for {kind} "
            f"({100 * reserved / device_gib:.0f}% of the card): expect allocator retries and a "
            f"slower step; leave more room (a smaller local_batch_size, activation checkpointing)"
        )
    return True, line


def candidate_knobs(config: JobConfig, world_size: int) -> list[tuple[str, dict]]:
    """Cheapest changes first: (description, {section.key: value})."""
    p, t = config.parallelism, config.training
    out = []
    if config.activation_checkpoint.mode != "full":
        out.append(("--activation_checkpoint.mode full", {"activation_checkpoint.mode": "full"}))
    # Resharding after forward frees the gathered weights: "default" does, except under
    # pipeline parallel, where only "always" does (and zero-bubble schedules refuse it).
    looser = "always" if p.pipeline_parallel_degree > 1 else "default"
    refused = looser == "always" and p.pipeline_parallel_schedule in SPLIT_BACKWARD
    if resolved_reshard_after_forward(p) == "never" and not refused:
        out.append(
            (
                f"--parallelism.fsdp_reshard_after_forward {looser}",
                {"parallelism.fsdp_reshard_after_forward": looser},
            )
        )
    if p.data_parallel_replicate_degree > 1:
        out.append(
            (
                "--parallelism.data_parallel_replicate_degree 1 (shard over every rank)",
                {"parallelism.data_parallel_replicate_degree": 1},
            )
        )
    if t.local_batch_size > 1:
        half = t.local_batch_size // 2
        # The global batch is the recipe: keep it, and the halved micro-batches accumulate.
        dp = build_parallel_dims(config, world_size).dp
        global_batch = t.local_batch_size * dp if t.global_batch_size == -1 else t.global_batch_size
        out.append(
            (
                f"--training.local_batch_size {half} --training.global_batch_size "
                f"{global_batch} (same global batch: gradient accumulation)",
                {"training.local_batch_size": half, "training.global_batch_size": global_batch},
            )
        )
    out.append(
        (
            f"--memory_estimation.world_size {2 * world_size} (twice the GPUs: smaller shards)",
            {"memory_estimation.world_size": 2 * world_size},
        )
    )
    return out


def apply_overrides(config: JobConfig, overrides: dict) -> JobConfig:
    import copy

    cfg = copy.deepcopy(config)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def format_report(est: dict, device_gib: float, fits: bool, line: str, tried: list) -> str:
    rows = [
        f"Memory estimate, rank {est['rank']} of {est['world_size']} ({est['parallel_dims']}; "
        f"grad accumulation {est['grad_accum']}), target {est['target']}",
        f"{'category':<28}{'GiB at peak':>12}",
    ]
    for key, gib in est["by_category"].items():
        rows.append(f"{LABELS[key]:<28}{gib:>12.2f}")
    rows.append(f"{'peak (allocated)':<28}{est['peak_gib']:>12.2f}   at {est['peak_where']}")
    rows.append(f"{'CUDA context + NCCL':<28}{est['context_gib']:>12.2f}   (constant)")
    rows.append(f"{'total':<28}{required_gib(est):>12.2f}")
    rows.append("top modules by activation memory (saved at the end of forward):")
    for m in est["top_modules"]:
        rows.append(f"  {m['module']:<40}{m['gib']:>8.3f} GiB")
    if len(est["ranks"]) > 1:
        rows.append(
            "peak per pipeline rank: "
            + ", ".join(f"{r['pipeline_rank']}: {r['peak_gib']:.2f} GiB" for r in est["ranks"])
        )
    rows.append(f"assumption: {est['ranks'][0]['assumption']}")
    rows.append(est["program"])
    rows += [f"note: {n}" for n in est["notes"]]
    if fits:
        rows.append(f"verdict: {line}")
    else:
        tries = "; ".join(
            f"{desc} -> {gib:.2f} GiB" if gib is not None else desc for desc, gib in tried
        )
        rows.append(f"verdict: {line}" + (f": try {tries}" if tries else "") + f"; {FEWEST_HINT}")
    return "\n".join(rows)


def write_json(path: str, est: dict | None, device_gib: float, extra: dict) -> None:
    """The estimate (none: a search that found no layout) and `extra` (fits, suggestions, the
    search's table) as JSON."""
    doc: dict = {"device_memory_gib": device_gib}
    if est is not None:
        doc.update(
            world_size=est["world_size"],
            peak_gib=required_gib(est),
            by_category={**est["by_category"], "cuda_context_nccl": est["context_gib"]},
            ranks=est["ranks"],
            allocated_peak_gib=est["peak_gib"],
            top_modules=est["top_modules"],
            notes=est["notes"],
            program=est["program"],
        )
    doc.update(extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)

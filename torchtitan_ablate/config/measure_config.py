"""The measurement sections of JobConfig: held-out validation, metrics, profiling and the
memory estimate (what a run observes rather than what it trains). Field docstrings are the
reference text, as in job_config.py."""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Validation:
    enable: bool = False
    """Measure the loss on held-out data during training (logged as validation_loss; with DPO
    also the reward accuracy, margin etc. as validation_rewards/*, validation_logps/*)."""

    dataset_path: str | None = None
    """Held-out .txt/.jsonl file or folder of the same kind as training.dataset (preference
    pairs for DPO), read with the training packing and sharding; a bad row stops the run. Not
    needed for synthetic data (a differently seeded stream)."""

    freq: int = 100
    """Steps between validations; the last step is always validated."""

    steps: int = 10
    """Micro-batches per data-parallel rank in each validation; every validation reads the same
    ones, so the figures of one run are comparable."""

    local_batch_size: int = -1
    """Sequences per validation micro-batch on each rank; -1 = training.local_batch_size (with
    pipeline parallel a multiple of it: the pipeline runs one training batch's shapes at a
    time). The memory estimate covers training steps: a no-grad validation step holds no
    activations for backward and needs less, unless its batch is many times training's."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log every this many steps (and the first and last)."""

    enable_tensorboard: bool = False
    """Also write TensorBoard events to <dump_folder>/<save_tb_folder>."""

    save_tb_folder: str = "tb"
    """TensorBoard folder inside job.dump_folder."""

    peak_tflops: float = -1.0
    """Device peak bf16 TFLOP/s for MFU; -1 = look the device up (H100/H200 989, A100 312)."""

    comm_profile: bool = False
    """Profile a short window of steps with torch.profiler and log the time shares of
    collectives, compute and data loading (communication / CPU overhead)."""

    enable_wandb: bool = False
    """Also log to Weights & Biases (rank 0): the metrics.jsonl fields and the resolved config.
    Needs the optional extra: pip install wandb."""

    wandb_project: str = "torchtitan_ablate"
    """W&B project."""

    wandb_run_name: str = ""
    """W&B run name; "" = the last folder of job.dump_folder."""

    wandb_group: str = ""
    """W&B group; "" = none. The ablation runner sets it to the ablation's name."""

    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags (on the command line: comma-separated)."""

    wandb_mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server; offline: write under <dump_folder>/wandb only (no
    network; upload later with `wandb sync`)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record a torch.profiler trace every profile_freq steps."""

    save_traces_folder: str = "profile_traces"
    """Trace folder inside job.dump_folder."""

    profile_freq: int = 10
    """Steps between traces."""


@dataclass
class MemoryEstimation:
    enable: bool = False
    """Estimate per-GPU peak memory instead of training (see estimation.py)."""

    world_size: int = -1
    """Ranks to model; -1 = NGPU * NNODES from the environment, else WORLD_SIZE, else 1."""

    device_memory_gib: float = -1.0
    """Device memory for the fits verdict; -1 = the detected GPU, else 80."""

    ep_imbalance: float = 1.0
    """Expert-parallel routing skew: the busiest rank gets this times the mean tokens."""

    output: str | None = None
    """Also write the estimate as JSON to this file."""

    trace_processes: int = 0
    """Processes tracing the pipeline ranks (each is one trace; without pipeline parallel there
    is one): 0 = one per pipeline rank up to the CPU count, 1 = all in this process."""

    fewest_gpus: bool = False
    """Search the fewest GPUs of device_memory_gib that fit, and the fastest layout among them by
    a stated rule (less recomputation first, then HSDP before FSDP; nodes of 8 GPUs): starts at
    the fewest that the model state and the layout allow, traces world sizes 1, 2, 4, ... and
    then layouts, and prints the table of what it tried (docs/memory_estimation.md). world_size
    is not used; PP, TP, EP and CP degrees, batch, compile and float8 stay the config's."""

"""The config rules of pipeline parallel (parallelism.pipeline_parallel_*), run by load_config
with the others (rules.py). The split against the model (stages per rank, tied embeddings, MoE)
is checked by build.check_layout, where the flavor's sizes are known."""

from torchtitan_ablate.config.dpo_config import dpo_enabled
from torchtitan_ablate.config.job_config import JobConfig
from torchtitan_ablate.config.require import at_least, require

# Schedules that split each backward into an input pass and a later weight pass: the input pass
# lists the weights to differentiate when it starts, so FSDP must not have resharded them after
# forward (models/qwen3/parallelize.py's check_fsdp_knobs, where FSDP's use is known).
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble")


def check_pipeline_parallel(config: JobConfig) -> None:
    """Ranges, settings that would be ignored without PP, and what PP does not combine with."""
    p = config.parallelism
    pp = p.pipeline_parallel_degree
    at_least("parallelism.pipeline_parallel_degree", pp, 1, " (1 = off)")
    mb = p.pipeline_parallel_microbatch_size
    at_least("parallelism.pipeline_parallel_microbatch_size", mb, 1)
    lps = p.pipeline_parallel_layers_per_stage
    require(
        lps is None or lps >= 1,
        f"parallelism.pipeline_parallel_layers_per_stage = {lps}: >= 1 (or unset)",
    )
    if pp == 1:
        settings = {
            f"pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r}": (
                p.pipeline_parallel_schedule != "1F1B"
            ),
            f"pipeline_parallel_microbatch_size = {mb}": mb != 1,
            f"pipeline_parallel_layers_per_stage = {lps}": lps is not None,
            "module_fqns_per_model_part": p.module_fqns_per_model_part is not None,
        }
        for name, on in settings.items():
            require(
                not on,
                f"parallelism.{name} needs parallelism.pipeline_parallel_degree > 1 (it is 1): "
                "remove it or set the degree",
            )
        return
    key = f"parallelism.pipeline_parallel_degree = {pp}"
    batch = config.training.local_batch_size
    require(
        batch % mb == 0,
        f"training.local_batch_size = {batch} must be a multiple of "
        f"parallelism.pipeline_parallel_microbatch_size = {mb} (the pipeline's micro-batches)",
    )
    v_batch = config.validation.local_batch_size
    require(
        not config.validation.enable or v_batch == -1 or v_batch % batch == 0,
        f"validation.local_batch_size = {v_batch} with {key} must be a multiple of "
        f"training.local_batch_size = {batch} (or -1): the pipeline's stages know the shapes "
        "of a training batch, and validation runs them one such batch at a time",
    )
    require(
        not dpo_enabled(config),
        f"{key} with training.dataset = 'preference' (DPO) is not supported yet; use one or "
        "the other",
    )

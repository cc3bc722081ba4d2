"""The rules a loaded JobConfig must meet beyond its types, one function per section.

Each rule lives once, here or (the data sections': [training], [validation], [dpo]) in
training_rules.py, and `load_config` runs them all: a value that would fail (or be silently ignored)
later fails at load time, before a process group or model is built. The code that uses a section
(apply_float8, apply_lora, ...) takes its settings as checked. Rules that need what the config
alone does not say live where that is known: degrees against the world size and the model
(experts vs EP, seq_len vs CP) in ParallelDims, the device and installed packages in the module
that uses them.
"""

from torchtitan_ablate.config.derived import compiles
from torchtitan_ablate.config.job_config import (
    LORA_TARGETS,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Float8,
    JobConfig,
    LoRA,
    MemoryEstimation,
    Metrics,
    Model,
    Parallelism,
    Profiling,
)
from torchtitan_ablate.config.optim_config import NO_DECAY_CLASSES, LRScheduler, Optimizer
from torchtitan_ablate.config.pipeline_rules import check_pipeline_parallel
from torchtitan_ablate.config.require import at_least, require, unset_or_positive
from torchtitan_ablate.config.training_rules import check_dpo, check_training, check_validation


def validate(config: JobConfig) -> None:
    """Raises ConfigError (one line: key, value, what is allowed) for the first broken rule."""
    check_training(config.training, config.checkpoint)
    _check_model(config.model, config.parallelism)
    _check_optimizer(config.optimizer)
    _check_lr_scheduler(config.lr_scheduler)
    check_validation(config.validation, config.training)
    _check_metrics(config.metrics, config.profiling)
    _check_profiling(config.profiling)
    _check_checkpoint(config.checkpoint)
    _check_seed_checkpoint(config)
    _check_comm(config.comm)
    _check_memory_estimation(config.memory_estimation)
    _check_activation_checkpoint(config.activation_checkpoint)
    _check_compile(config.compile)
    if config.float8.enable:  # off, its settings are not read
        _check_float8(config.float8)
    if config.lora.enable:
        _check_lora(config.lora)
    _check_ep_dispatch(config)
    _check_tensor_parallel(config)
    check_pipeline_parallel(config)
    check_dpo(config)
    _check_force_load_balance(config)


def _check_model(m: Model, parallelism: Parallelism) -> None:
    for key in ("vocab_size", "n_layers", "num_experts"):
        value = getattr(m, key)
        require(
            value == -1 or value >= 1,
            f"model.{key} = {value}: -1 (keep the flavor's value) or >= 1",
        )
    require(
        m.moe_aux_loss_coef == -1 or m.moe_aux_loss_coef >= 0,
        f"model.moe_aux_loss_coef = {m.moe_aux_loss_coef}: -1 (keep the flavor's value) or >= 0",
    )
    at_least("model.moe_bias_update_rate", m.moe_bias_update_rate, 0, " (0 = off)")
    cp = parallelism.context_parallel_degree
    require(
        cp == 1 or m.attn_backend == "auto",
        f"model.attn_backend = {m.attn_backend!r} with context_parallel_degree = {cp}: context "
        "parallel runs its own attention (compiled flex on CUDA, SDPA with a dense mask on CPU); "
        "set model.attn_backend = 'auto'",
    )


def _check_ep_dispatch(config: JobConfig) -> None:
    if config.parallelism.expert_parallel_dispatch == "rows":
        return
    key = "parallelism.expert_parallel_dispatch = 'tokens'"
    ep = config.parallelism.expert_parallel_degree
    require(ep > 1, f"{key} needs parallelism.expert_parallel_degree > 1 (it is {ep})")


def _check_tensor_parallel(config: JobConfig) -> None:
    """What tensor parallel does not combine with yet (the model's sizes are checked in
    ParallelDims.check_model, where the flavor is known)."""
    p = config.parallelism
    tp = p.tensor_parallel_degree
    require(tp >= 1, f"parallelism.tensor_parallel_degree = {tp}: must be >= 1")
    if p.enable_async_tensor_parallel:
        key = "parallelism.enable_async_tensor_parallel = true"
        require(tp > 1, f"{key} needs parallelism.tensor_parallel_degree > 1 (it is {tp})")
        require(
            compiles(config.compile, "model"),
            f"{key} needs the blocks compiled (compile.enable = true, 'model' in "
            "compile.components): the overlap is a torch.compile pass",
        )
    if tp == 1:
        return
    key = f"parallelism.tensor_parallel_degree = {tp}"
    f8 = config.float8
    require(
        not f8.enable or f8.recipe == "tensorwise",
        f"{key} with float8.recipe = {f8.recipe!r} is not supported: torchao's float8 tensor "
        "parallel styles are tensorwise only; set float8.recipe = 'tensorwise'",
    )


def _check_force_load_balance(config: JobConfig) -> None:
    """Forced routing ignores the router's choice: what would act on that choice, or keep
    weights trained without it, is refused (dense flavors are refused where the flavor is
    known, models/qwen3/sizes.py)."""
    if not config.debug.moe_force_load_balance:
        return
    key = "debug.moe_force_load_balance = true (benchmarks only: round-robin routing)"
    m = config.model
    require(
        m.moe_aux_loss_coef == 0,
        f"{key} leaves the load-balancing loss nothing to balance, but model.moe_aux_loss_coef "
        f"= {m.moe_aux_loss_coef} (-1 keeps the flavor's 0.001): set it to 0",
    )
    require(
        m.moe_bias_update_rate == 0,
        f"{key}: the expert bias cannot move a forced selection; set "
        "model.moe_bias_update_rate = 0",
    )
    require(
        not config.checkpoint.enable,
        f"{key} with checkpoint.enable = true: weights trained without the router's choice "
        "route differently in any normal run or HF export; set checkpoint.enable = false",
    )
    imbalance = config.memory_estimation.ep_imbalance
    require(
        imbalance == 1,
        f"{key} gives every EP rank the same rows, but memory_estimation.ep_imbalance = "
        f"{imbalance}: set it to 1",
    )


def _check_optimizer(o: Optimizer) -> None:
    require(o.lr > 0, f"optimizer.lr = {o.lr}: must be > 0")
    for key in ("beta1", "beta2"):  # torch.optim.Adam(W)'s own rules
        value = getattr(o, key)
        require(0.0 <= value < 1.0, f"optimizer.{key} = {value}: must be in [0, 1)")
    at_least("optimizer.eps", o.eps, 0)
    at_least("optimizer.weight_decay", o.weight_decay, 0, " (0 = no weight decay)")
    unknown = [x for x in o.no_decay if x not in NO_DECAY_CLASSES]
    require(
        not unknown,
        f"optimizer.no_decay = {o.no_decay}: unknown {unknown}; choose from "
        f"{list(NO_DECAY_CLASSES)}, or [] to decay every parameter",
    )


def _check_lr_scheduler(s: LRScheduler) -> None:
    require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps = {s.warmup_steps}: must be >= 0")
    r = s.warmup_ratio
    require(r is None or 0.0 <= r <= 1.0, f"lr_scheduler.warmup_ratio = {r}: must be in [0, 1]")
    d = s.decay_ratio
    require(d is None or 0.0 <= d <= 1.0, f"lr_scheduler.decay_ratio = {d}: must be in [0, 1]")
    require(
        0.0 <= s.min_lr_factor <= 1.0,
        f"lr_scheduler.min_lr_factor = {s.min_lr_factor}: must be in [0, 1] (the final learning "
        "rate as a fraction of optimizer.lr)",
    )


def _check_metrics(metrics: Metrics, profiling: Profiling) -> None:
    require(metrics.log_freq >= 1, f"metrics.log_freq = {metrics.log_freq}: >= 1")
    unset_or_positive("metrics.peak_tflops", metrics.peak_tflops, "look the device up")
    require(
        not (metrics.comm_profile and profiling.enable_profiling),
        "metrics.comm_profile and profiling.enable_profiling both run torch.profiler, which "
        "cannot nest: enable one of them",
    )


def _check_profiling(p: Profiling) -> None:
    require(
        p.profile_freq >= 2,
        f"profiling.profile_freq = {p.profile_freq}: must be >= 2 (one warm-up step, then the "
        "traced step)",
    )


def _check_checkpoint(ck: Checkpoint) -> None:
    require(ck.interval >= 1, f"checkpoint.interval = {ck.interval}: must be >= 1")
    at_least("checkpoint.keep_latest_k", ck.keep_latest_k, 0, " (0 keeps every checkpoint)")
    require(
        ck.enable or not ck.last_save_in_hf,
        "checkpoint.last_save_in_hf = true needs checkpoint.enable = true (the HF copy is made "
        "from the last step's checkpoint)",
    )


def _check_seed_checkpoint(config: JobConfig) -> None:
    """create_seed_checkpoint: one process writes fresh weights (torchtitan's rules, plus what
    would otherwise be ignored)."""
    ck, p = config.checkpoint, config.parallelism
    if not ck.create_seed_checkpoint:
        return
    key = "checkpoint.create_seed_checkpoint = true"
    require(ck.enable, f"{key} needs checkpoint.enable = true (it writes the checkpoint folder)")
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    for name, degree in degrees.items():
        require(
            degree == 1 or (name == "data_parallel_shard_degree" and degree == -1),
            f"{key}: parallelism.{name} = {degree}; the seed checkpoint is written by one "
            "process: set the degrees to 1 and start one process (NGPU=1); every layout then "
            "loads it through checkpoint.initial_load_path",
        )
    require(
        ck.initial_load_path is None,
        f"{key} writes freshly initialised weights, but checkpoint.initial_load_path = "
        f"{ck.initial_load_path!r} is set; remove one (scripts/convert_checkpoint.py converts "
        "existing weights)",
    )
    require(
        not config.memory_estimation.enable,
        f"{key} and memory_estimation.enable = true: run them separately",
    )


def _check_comm(c: Comm) -> None:
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        at_least(f"comm.{key}", getattr(c, key), 1, " (seconds a rank waits in a collective)")


def _check_memory_estimation(me: MemoryEstimation) -> None:
    unset_or_positive(
        "memory_estimation.device_memory_gib", me.device_memory_gib, "the detected GPU, else 80"
    )
    require(
        me.world_size == -1 or me.world_size >= 1,
        f"memory_estimation.world_size = {me.world_size}: -1 (from the environment) or >= 1",
    )
    at_least("memory_estimation.ep_imbalance", me.ep_imbalance, 1, " (1 = balanced routing)")
    at_least("memory_estimation.trace_processes", me.trace_processes, 0, " (0 = automatic)")


def _check_activation_checkpoint(ac: ActivationCheckpoint) -> None:
    opt = ac.selective_ac_option
    require(
        opt == "op" or (opt.isdigit() and int(opt) >= 1),
        f"activation_checkpoint.selective_ac_option = {opt!r}: 'op' or a positive integer",
    )


def _check_compile(c: Compile) -> None:
    bad = [x for x in c.components if x not in ("model", "loss")]
    require(not bad, f"compile.components = {bad}: allowed are 'model', 'loss'")
    require(
        not c.enable or bool(c.components),
        "compile.enable = true with compile.components = [] compiles nothing: list 'model' "
        "and/or 'loss', or set compile.enable = false",
    )


def _check_float8(f8: Float8) -> None:
    """The recipe rules of torchao; the device rules (CUDA, SM) are checked by apply_float8."""
    require(
        not f8.enable_fsdp_float8_all_gather or f8.recipe == "tensorwise",
        f"float8.enable_fsdp_float8_all_gather = true needs float8.recipe = 'tensorwise' "
        f"(got {f8.recipe!r}): rowwise scales cannot be computed before the all-gather",
    )
    require(
        not f8.moe or f8.recipe == "rowwise",
        f"float8.moe = true needs float8.recipe = 'rowwise' (got {f8.recipe!r}): "
        "torchao's float8 grouped GEMM for experts is rowwise only",
    )


def _check_lora(lora: LoRA) -> None:
    require(lora.rank >= 1, f"lora.rank = {lora.rank}: must be >= 1")
    require(lora.alpha > 0, f"lora.alpha = {lora.alpha}: must be > 0 (scale alpha / rank)")
    require(0.0 <= lora.dropout < 1.0, f"lora.dropout = {lora.dropout}: must be in [0, 1)")
    allowed = list(LORA_TARGETS)
    unknown = [x for x in lora.target_modules if x not in allowed]
    require(
        bool(lora.target_modules) and not unknown,
        f"lora.target_modules = {lora.target_modules}: choose one or more of {allowed}",
    )

"""The rules a loaded JobConfig must meet beyond its types, one function per section.

Each rule lives here once, and `load_config` runs them all: a value that would fail (or be
silently ignored) later fails at load time, before a process group or model is built. The code
that uses a section (apply_float8, apply_lora, ...) takes its settings as checked. Rules that need
what the config alone does not say live where that is known: degrees against the world size and
the model (experts vs EP, seq_len vs CP) in ParallelDims, the device and installed packages in the
module that uses them.
"""

from torchtitan_ablate.config.dpo_config import DPO
from torchtitan_ablate.config.errors import ConfigError
from torchtitan_ablate.config.job_config import (
    LORA_TARGETS,
    NO_DECAY_CLASSES,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Float8,
    JobConfig,
    LoRA,
    LRScheduler,
    MemoryEstimation,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)


def validate(config: JobConfig) -> None:
    """Raises ConfigError (one line: key, value, what is allowed) for the first broken rule."""
    _check_training(config.training, config.checkpoint)
    _check_model(config.model, config.parallelism)
    _check_optimizer(config.optimizer)
    _check_lr_scheduler(config.lr_scheduler)
    _check_validation(config.validation, config.training)
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
    _check_dpo(config)


def _check_ep_dispatch(config: JobConfig) -> None:
    if config.parallelism.expert_parallel_dispatch == "rows":
        return
    key = "parallelism.expert_parallel_dispatch = 'tokens'"
    ep = config.parallelism.expert_parallel_degree
    _require(ep > 1, f"{key} needs parallelism.expert_parallel_degree > 1 (it is {ep})")
    _require(
        not (config.lora.enable and "experts" in config.lora.target_modules),
        f"{key} with LoRA on the experts (lora.target_modules has 'experts'): the adapters run "
        "with row dispatch only; set expert_parallel_dispatch = 'rows'",
    )


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _at_least(key: str, value: float, low: float, note: str = "") -> None:
    _require(value >= low, f"{key} = {value}: must be >= {low}{note}")


def _unset_or_positive(key: str, value: float, unset: str) -> None:
    _require(value == -1 or value > 0, f"{key} = {value}: -1 ({unset}) or > 0")


def _check_training(t: Training, checkpoint: Checkpoint) -> None:
    _require(t.local_batch_size >= 1, f"training.local_batch_size = {t.local_batch_size}: >= 1")
    _require(t.seq_len >= 2, f"training.seq_len = {t.seq_len}: must be >= 2")
    _require(t.steps >= 1, f"training.steps = {t.steps}: must be >= 1")
    _require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        f"training.global_batch_size = {t.global_batch_size}: -1 or a positive multiple of "
        "local_batch_size * data-parallel degree",
    )
    _require(
        t.dataset != "text" or bool(t.dataset_path),
        "training.dataset = 'text' needs training.dataset_path (a .txt/.jsonl/.parquet file or "
        "folder, or a list of them)",
    )
    _check_data_sources(t)
    _require(
        t.exit_at_step == -1 or (checkpoint.enable and 1 <= t.exit_at_step),
        f"training.exit_at_step = {t.exit_at_step} needs checkpoint.enable = true (the run "
        "saves there and resumes later) and a step >= 1",
    )
    _require(
        t.exit_at_step <= t.steps,
        f"training.exit_at_step = {t.exit_at_step} is after the last step (training.steps = "
        f"{t.steps}) and would never stop the run: use a step in 1..{t.steps}, or -1",
    )
    _require(
        t.packing != "best_fit" or t.dataset in ("chat", "preference"),
        f"training.packing = 'best_fit' packs whole conversations (training.dataset = 'chat' "
        f"or 'preference'); with dataset = {t.dataset!r} use greedy or padding",
    )
    _require(
        not (t.dataset in ("chat", "preference") and t.data_sharding == "rows"),
        "training.data_sharding = 'rows' is for text and synthetic data; chat (SFT) and "
        "preference data are sharded by conversation: use data_sharding = 'documents'",
    )
    _at_least("training.gc_freq", t.gc_freq, 1, " (garbage collection every n steps)")
    _at_least("training.max_norm", t.max_norm, 0, " (0 turns gradient clipping off)")
    _at_least("training.skip_nonfinite_steps", t.skip_nonfinite_steps, 0, " (0 stops at a NaN)")
    _at_least("training.loss_chunk_size", t.loss_chunk_size, 0, " (0 = plain loss on full logits)")
    _require(
        t.loss_impl != "chunked" or t.loss_chunk_size > 0,
        "training.loss_impl = 'chunked' needs training.loss_chunk_size > 0 (tokens per chunk); "
        "for the loss on full logits use loss_impl = 'plain'",
    )
    _require(
        t.loss_impl not in ("liger", "cce") or t.device != "cpu",
        f"training.loss_impl = {t.loss_impl!r} needs CUDA (a Triton kernel) and training.device "
        "= 'cpu'; use loss_impl = 'chunked' or 'plain' on CPU",
    )
    _require(
        t.loss_impl != "cce" or t.mixed_precision_param == "bfloat16",
        "training.loss_impl = 'cce' trains bf16 hidden states only (its backward) and "
        "training.mixed_precision_param = 'float32': set it to 'bfloat16' or use "
        "loss_impl = 'liger' or 'chunked'",
    )
    _at_least("training.throughput_warmup_steps", t.throughput_warmup_steps, 0)
    _require(
        0 <= t.throughput_noise_target < 1,
        f"training.throughput_noise_target = {t.throughput_noise_target}: a fraction in [0, 1) "
        "(e.g. 0.02 for 2%; 0 = off)",
    )
    _at_least("training.num_workers", t.num_workers, 0, " (0 = load data in the main process)")


def _check_data_sources(t: Training) -> None:
    paths, weights = t.dataset_path, t.dataset_weights
    if isinstance(paths, list):
        _require(
            t.dataset == "text" and len(paths) > 0 and all(paths),
            f"training.dataset_path = {paths}: a list (a data mixture) needs training.dataset = "
            "'text' and at least one non-empty path",
        )
        _require(
            not weights or len(weights) == len(paths),
            f"training.dataset_weights = {weights}: one weight per training.dataset_path entry "
            f"({len(paths)}), or empty for equal weights",
        )
    else:
        _require(
            not weights,
            f"training.dataset_weights = {weights}: weights mix a list of dataset paths; "
            "training.dataset_path is one path",
        )
    _require(
        all(w > 0 for w in weights),
        f"training.dataset_weights = {weights}: every weight must be > 0",
    )
    _require(bool(t.dataset_text_field), "training.dataset_text_field must not be empty")
    _require(
        t.dataset == "text" or t.dataset_text_field == "text",
        f"training.dataset_text_field = {t.dataset_text_field!r} names the field of text data; "
        f"training.dataset = {t.dataset!r} does not read it: remove it",
    )
    _at_least("training.shuffle_buffer", t.shuffle_buffer, 0, " (0 = read in file order)")


def _check_model(m: Model, parallelism: Parallelism) -> None:
    for key in ("vocab_size", "n_layers", "num_experts"):
        value = getattr(m, key)
        _require(
            value == -1 or value >= 1,
            f"model.{key} = {value}: -1 (keep the flavor's value) or >= 1",
        )
    _require(
        m.moe_aux_loss_coef == -1 or m.moe_aux_loss_coef >= 0,
        f"model.moe_aux_loss_coef = {m.moe_aux_loss_coef}: -1 (keep the flavor's value) or >= 0",
    )
    _at_least("model.moe_bias_update_rate", m.moe_bias_update_rate, 0, " (0 = off)")
    cp = parallelism.context_parallel_degree
    _require(
        cp == 1 or m.attn_backend == "auto",
        f"model.attn_backend = {m.attn_backend!r} with context_parallel_degree = {cp}: context "
        "parallel runs its own attention (compiled flex on CUDA, SDPA with a dense mask on CPU); "
        "set model.attn_backend = 'auto'",
    )


def _check_optimizer(o: Optimizer) -> None:
    _require(o.lr > 0, f"optimizer.lr = {o.lr}: must be > 0")
    for key in ("beta1", "beta2"):  # torch.optim.Adam(W)'s own rules
        value = getattr(o, key)
        _require(0.0 <= value < 1.0, f"optimizer.{key} = {value}: must be in [0, 1)")
    _at_least("optimizer.eps", o.eps, 0)
    _at_least("optimizer.weight_decay", o.weight_decay, 0, " (0 = no weight decay)")
    unknown = [x for x in o.no_decay if x not in NO_DECAY_CLASSES]
    _require(
        not unknown,
        f"optimizer.no_decay = {o.no_decay}: unknown {unknown}; choose from "
        f"{list(NO_DECAY_CLASSES)}, or [] to decay every parameter",
    )


def _check_lr_scheduler(s: LRScheduler) -> None:
    _require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps = {s.warmup_steps}: must be >= 0")
    d = s.decay_ratio
    _require(d is None or 0.0 <= d <= 1.0, f"lr_scheduler.decay_ratio = {d}: must be in [0, 1]")
    _require(
        0.0 <= s.min_lr_factor <= 1.0,
        f"lr_scheduler.min_lr_factor = {s.min_lr_factor}: must be in [0, 1] (the final learning "
        "rate as a fraction of optimizer.lr)",
    )


def _check_validation(v: Validation, training: Training) -> None:
    dataset = training.dataset
    _require(
        not v.enable or dataset == "synthetic" or bool(v.dataset_path),
        f"validation.enable = true with training.dataset = {dataset!r} needs "
        "validation.dataset_path (held-out data of the same kind)",
    )
    _require(
        not (dataset == "synthetic" and v.dataset_path),
        f"validation.dataset_path = {v.dataset_path!r} is not read with training.dataset = "
        "'synthetic' (validation uses a differently seeded stream): remove it",
    )
    _at_least("validation.freq", v.freq, 1, " (validate every n steps)")
    _at_least("validation.steps", v.steps, 1, " (micro-batches per validation)")
    _require(
        v.local_batch_size == -1 or v.local_batch_size >= 1,
        f"validation.local_batch_size = {v.local_batch_size}: -1 (training's) or >= 1",
    )


def _check_metrics(metrics: Metrics, profiling: Profiling) -> None:
    _require(metrics.log_freq >= 1, f"metrics.log_freq = {metrics.log_freq}: >= 1")
    _unset_or_positive("metrics.peak_tflops", metrics.peak_tflops, "look the device up")
    _require(
        not (metrics.comm_profile and profiling.enable_profiling),
        "metrics.comm_profile and profiling.enable_profiling both run torch.profiler, which "
        "cannot nest: enable one of them",
    )


def _check_profiling(p: Profiling) -> None:
    _require(
        p.profile_freq >= 2,
        f"profiling.profile_freq = {p.profile_freq}: must be >= 2 (one warm-up step, then the "
        "traced step)",
    )


def _check_checkpoint(ck: Checkpoint) -> None:
    _require(ck.interval >= 1, f"checkpoint.interval = {ck.interval}: must be >= 1")
    _at_least("checkpoint.keep_latest_k", ck.keep_latest_k, 0, " (0 keeps every checkpoint)")


def _check_seed_checkpoint(config: JobConfig) -> None:
    """create_seed_checkpoint: one process writes fresh weights (torchtitan's rules, plus what
    would otherwise be ignored)."""
    ck, p = config.checkpoint, config.parallelism
    if not ck.create_seed_checkpoint:
        return
    key = "checkpoint.create_seed_checkpoint = true"
    _require(ck.enable, f"{key} needs checkpoint.enable = true (it writes the checkpoint folder)")
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for name, degree in degrees.items():
        _require(
            degree == 1 or (name == "data_parallel_shard_degree" and degree == -1),
            f"{key}: parallelism.{name} = {degree}; the seed checkpoint is written by one "
            "process: set the degrees to 1 and start one process (NGPU=1); every layout then "
            "loads it through checkpoint.initial_load_path",
        )
    _require(
        ck.initial_load_path is None,
        f"{key} writes freshly initialised weights, but checkpoint.initial_load_path = "
        f"{ck.initial_load_path!r} is set; remove one (scripts/convert_checkpoint.py converts "
        "existing weights)",
    )
    _require(
        not config.memory_estimation.enable,
        f"{key} and memory_estimation.enable = true: run them separately",
    )


def _check_comm(c: Comm) -> None:
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        _at_least(f"comm.{key}", getattr(c, key), 1, " (seconds a rank waits in a collective)")


def _check_memory_estimation(me: MemoryEstimation) -> None:
    _unset_or_positive(
        "memory_estimation.device_memory_gib", me.device_memory_gib, "the detected GPU, else 80"
    )
    _require(
        me.world_size == -1 or me.world_size >= 1,
        f"memory_estimation.world_size = {me.world_size}: -1 (from the environment) or >= 1",
    )
    _at_least("memory_estimation.ep_imbalance", me.ep_imbalance, 1, " (1 = balanced routing)")


def _check_activation_checkpoint(ac: ActivationCheckpoint) -> None:
    opt = ac.selective_ac_option
    _require(
        opt == "op" or (opt.isdigit() and int(opt) >= 1),
        f"activation_checkpoint.selective_ac_option = {opt!r}: 'op' or a positive integer",
    )


def _check_compile(c: Compile) -> None:
    bad = [x for x in c.components if x not in ("model", "loss")]
    _require(not bad, f"compile.components = {bad}: allowed are 'model', 'loss'")
    _require(
        not c.enable or bool(c.components),
        "compile.enable = true with compile.components = [] compiles nothing: list 'model' "
        "and/or 'loss', or set compile.enable = false",
    )


def _check_float8(f8: Float8) -> None:
    """The recipe rules of torchao; the device rules (CUDA, SM) are checked by apply_float8."""
    _require(
        not f8.enable_fsdp_float8_all_gather or f8.recipe == "tensorwise",
        f"float8.enable_fsdp_float8_all_gather = true needs float8.recipe = 'tensorwise' "
        f"(got {f8.recipe!r}): rowwise scales cannot be computed before the all-gather",
    )
    _require(
        not f8.moe or f8.recipe == "rowwise",
        f"float8.moe = true needs float8.recipe = 'rowwise' (got {f8.recipe!r}): "
        "torchao's float8 grouped GEMM for experts is rowwise only",
    )


def _check_lora(lora: LoRA) -> None:
    _require(lora.rank >= 1, f"lora.rank = {lora.rank}: must be >= 1")
    _require(lora.alpha > 0, f"lora.alpha = {lora.alpha}: must be > 0 (scale alpha / rank)")
    _require(0.0 <= lora.dropout < 1.0, f"lora.dropout = {lora.dropout}: must be in [0, 1)")
    allowed = list(LORA_TARGETS)
    unknown = [x for x in lora.target_modules if x not in allowed]
    _require(
        bool(lora.target_modules) and not unknown,
        f"lora.target_modules = {lora.target_modules}: choose one or more of {allowed}",
    )


def _check_dpo(config: JobConfig) -> None:
    """[dpo] is read with training.dataset = 'preference' only; DPO's own data rules."""
    d, t = config.dpo, config.training
    if t.dataset != "preference":
        _require(
            d == DPO(),
            f"[dpo] is set ({d}) but training.dataset = {t.dataset!r}: DPO trains on "
            "training.dataset = 'preference'; remove the [dpo] keys or change the dataset",
        )
        return
    _require(d.beta > 0, f"dpo.beta = {d.beta}: must be > 0")
    _require(
        d.loss_type == "robust" or d.label_smoothing == 0,
        f"dpo.label_smoothing = {d.label_smoothing} is read by dpo.loss_type = 'robust' only "
        f"(got {d.loss_type!r}): set it to 0 or use loss_type = 'robust'",
    )
    _require(
        0 <= d.label_smoothing < 0.5,
        f"dpo.label_smoothing = {d.label_smoothing}: the flip probability, in [0, 0.5)",
    )
    _at_least("dpo.max_bad_rows", d.max_bad_rows, 0, " (0 = the first bad row stops the run)")
    _require(
        bool(t.dataset_path),
        "training.dataset = 'preference' needs training.dataset_path (a .jsonl file or folder)",
    )
    _require(
        t.loss_impl in ("auto", "chunked", "plain"),
        f"training.loss_impl = {t.loss_impl!r}: DPO computes per-token log-probabilities with "
        "its own chunked head (training.loss_chunk_size tokens at a time); use auto, chunked "
        "or plain",
    )
    _require(
        not config.validation.enable,
        "validation.enable = true with training.dataset = 'preference': held-out DPO "
        "validation is not implemented; set validation.enable = false",
    )
    _require(
        not (config.lora.enable and config.model.moe_bias_update_rate > 0),
        "model.moe_bias_update_rate > 0 with DPO and LoRA: the reference pass (adapters off) "
        "runs through the same routers and would count in their load; set it to 0",
    )

"""The rules of the training data sections: [training] (batch, steps, data sources, loader),
[validation] and [dpo] (rules.py runs them with the others)."""

from torchtitan_ablate.config.dpo_config import DPO
from torchtitan_ablate.config.job_config import Checkpoint, JobConfig, Training, Validation
from torchtitan_ablate.config.require import at_least, require


def check_training(t: Training, checkpoint: Checkpoint) -> None:
    require(t.local_batch_size >= 1, f"training.local_batch_size = {t.local_batch_size}: >= 1")
    require(t.seq_len >= 2, f"training.seq_len = {t.seq_len}: must be >= 2")
    require(t.steps >= 1, f"training.steps = {t.steps}: must be >= 1")
    require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        f"training.global_batch_size = {t.global_batch_size}: -1 or a positive multiple of "
        "local_batch_size * data-parallel degree",
    )
    require(
        t.dataset != "text" or bool(t.dataset_path),
        "training.dataset = 'text' needs training.dataset_path (a .txt/.jsonl/.parquet file or "
        "folder, or a list of them)",
    )
    _check_data_sources(t)
    require(
        t.exit_at_step == -1 or (checkpoint.enable and 1 <= t.exit_at_step),
        f"training.exit_at_step = {t.exit_at_step} needs checkpoint.enable = true (the run "
        "saves there and resumes later) and a step >= 1",
    )
    _check_epochs(t)
    require(
        t.epochs is not None or t.exit_at_step <= t.steps,  # with epochs: once they are counted
        f"training.exit_at_step = {t.exit_at_step} is after the last step (training.steps = "
        f"{t.steps}) and would never stop the run: use a step in 1..{t.steps}, or -1",
    )
    require(
        t.packing != "best_fit" or t.dataset in ("chat", "preference"),
        f"training.packing = 'best_fit' packs whole conversations (training.dataset = 'chat' "
        f"or 'preference'); with dataset = {t.dataset!r} use greedy or padding",
    )
    require(
        not (t.dataset in ("chat", "preference") and t.data_sharding == "rows"),
        "training.data_sharding = 'rows' is for text and synthetic data; chat (SFT) and "
        "preference data are sharded by conversation: use data_sharding = 'documents'",
    )
    at_least("training.gc_freq", t.gc_freq, 1, " (garbage collection every n steps)")
    at_least("training.max_norm", t.max_norm, 0, " (0 turns gradient clipping off)")
    at_least("training.sigterm_grace_seconds", t.sigterm_grace_seconds, 0, " (0 = no limit)")
    at_least("training.skip_nonfinite_steps", t.skip_nonfinite_steps, 0, " (0 stops at a NaN)")
    at_least("training.loss_chunk_size", t.loss_chunk_size, 0, " (0 = plain loss on full logits)")
    require(
        t.loss_impl != "chunked" or t.loss_chunk_size > 0,
        "training.loss_impl = 'chunked' needs training.loss_chunk_size > 0 (tokens per chunk); "
        "for the loss on full logits use loss_impl = 'plain'",
    )
    require(
        t.loss_impl not in ("liger", "cce") or t.device != "cpu",
        f"training.loss_impl = {t.loss_impl!r} needs CUDA (a Triton kernel) and training.device "
        "= 'cpu'; use loss_impl = 'chunked' or 'plain' on CPU",
    )
    require(
        t.loss_impl != "cce" or t.mixed_precision_param == "bfloat16",
        "training.loss_impl = 'cce' trains bf16 hidden states only (its backward) and "
        "training.mixed_precision_param = 'float32': set it to 'bfloat16' or use "
        "loss_impl = 'liger' or 'chunked'",
    )
    at_least("training.throughput_warmup_steps", t.throughput_warmup_steps, 0)
    require(
        0 <= t.throughput_noise_target < 1,
        f"training.throughput_noise_target = {t.throughput_noise_target}: a fraction in [0, 1) "
        "(e.g. 0.02 for 2%; 0 = off)",
    )
    at_least("training.num_workers", t.num_workers, 0, " (0 = load data in the main process)")


def _check_epochs(t: Training) -> None:
    if t.epochs is None:
        return
    require(t.epochs > 0, f"training.epochs = {t.epochs}: must be > 0 (passes over the data)")
    require(
        t.dataset != "synthetic",
        "training.epochs needs data with a size, and training.dataset = 'synthetic' never ends: "
        "set training.steps instead",
    )


def _check_data_sources(t: Training) -> None:
    paths, weights = t.dataset_path, t.dataset_weights
    if isinstance(paths, list):
        require(
            t.dataset == "text" and len(paths) > 0 and all(paths),
            f"training.dataset_path = {paths}: a list (a data mixture) needs training.dataset = "
            "'text' and at least one non-empty path",
        )
        require(
            not weights or len(weights) == len(paths),
            f"training.dataset_weights = {weights}: one weight per training.dataset_path entry "
            f"({len(paths)}), or empty for equal weights",
        )
    else:
        require(
            not weights,
            f"training.dataset_weights = {weights}: weights mix a list of dataset paths; "
            "training.dataset_path is one path",
        )
    require(
        all(w > 0 for w in weights),
        f"training.dataset_weights = {weights}: every weight must be > 0",
    )
    require(bool(t.dataset_text_field), "training.dataset_text_field must not be empty")
    require(
        t.dataset == "text" or t.dataset_text_field == "text",
        f"training.dataset_text_field = {t.dataset_text_field!r} names the field of text data; "
        f"training.dataset = {t.dataset!r} does not read it: remove it",
    )
    at_least("training.shuffle_buffer", t.shuffle_buffer, 0, " (0 = read in file order)")
    at_least("training.synthetic_doc_len", t.synthetic_doc_len, 0, " (0 = random lengths)")
    require(
        t.dataset == "synthetic" or t.synthetic_doc_len == 0,
        f"training.synthetic_doc_len = {t.synthetic_doc_len} sets the length of synthetic "
        f"documents; training.dataset = {t.dataset!r} does not make any: remove it",
    )


def check_validation(v: Validation, training: Training) -> None:
    dataset = training.dataset
    require(
        not v.enable or dataset == "synthetic" or bool(v.dataset_path),
        f"validation.enable = true with training.dataset = {dataset!r} needs "
        "validation.dataset_path (held-out data of the same kind)",
    )
    require(
        not (dataset == "synthetic" and v.dataset_path),
        f"validation.dataset_path = {v.dataset_path!r} is not read with training.dataset = "
        "'synthetic' (validation uses a differently seeded stream): remove it",
    )
    at_least("validation.freq", v.freq, 1, " (validate every n steps)")
    at_least("validation.steps", v.steps, 1, " (micro-batches per validation)")
    require(
        v.local_batch_size == -1 or v.local_batch_size >= 1,
        f"validation.local_batch_size = {v.local_batch_size}: -1 (training's) or >= 1",
    )


def check_dpo(config: JobConfig) -> None:
    """[dpo] is read with training.dataset = 'preference' only; DPO's own data rules."""
    d, t = config.dpo, config.training
    if t.dataset != "preference":
        require(
            d == DPO(),
            f"[dpo] is set ({d}) but training.dataset = {t.dataset!r}: DPO trains on "
            "training.dataset = 'preference'; remove the [dpo] keys or change the dataset",
        )
        return
    require(d.beta > 0, f"dpo.beta = {d.beta}: must be > 0")
    require(
        d.loss_type == "robust" or d.label_smoothing == 0,
        f"dpo.label_smoothing = {d.label_smoothing} is read by dpo.loss_type = 'robust' only "
        f"(got {d.loss_type!r}): set it to 0 or use loss_type = 'robust'",
    )
    require(
        0 <= d.label_smoothing < 0.5,
        f"dpo.label_smoothing = {d.label_smoothing}: the flip probability, in [0, 0.5)",
    )
    at_least("dpo.max_bad_rows", d.max_bad_rows, 0, " (0 = the first bad row stops the run)")
    require(
        bool(t.dataset_path),
        "training.dataset = 'preference' needs training.dataset_path (a .jsonl file or folder)",
    )
    require(
        t.loss_impl in ("auto", "chunked", "plain"),
        f"training.loss_impl = {t.loss_impl!r}: DPO computes per-token log-probabilities with "
        "its own chunked head (training.loss_chunk_size tokens at a time); use auto, chunked "
        "or plain",
    )
    require(
        not (config.lora.enable and config.model.moe_bias_update_rate > 0),
        "model.moe_bias_update_rate > 0 with DPO and LoRA: the reference pass (adapters off) "
        "runs through the same routers and would count in their load; set it to 0",
    )

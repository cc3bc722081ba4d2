"""Trainer: `python -m torchtitan_ablate.train --job.config_file X [--section.key value ...]`.

Build path (DESIGN.md): config -> process group + ParallelDims -> meta-device model ->
parallelize_qwen3 -> to_empty -> init_weights -> optimizer, LR schedule, data, checkpoint,
metrics -> train. Legend: B batch, S sequence, V vocabulary.
"""

import dataclasses
import gc
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator

# Before the first CUDA allocation: growable segments instead of fixed blocks, so a run near the
# memory limit (Qwen3-4B with AdamW on one 80 GB GPU) does not stall on fragmentation retries.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from torchtitan_ablate.components.checkpoint import CheckpointManager
from torchtitan_ablate.components.data import build_dataloader, state_same_on_every_rank
from torchtitan_ablate.components.hf_checkpoint import hf_model_args
from torchtitan_ablate.components.loss import cross_entropy_sum, num_valid_tokens
from torchtitan_ablate.components.lr_scheduler import build_lr_scheduler
from torchtitan_ablate.components.metrics import MetricsLogger
from torchtitan_ablate.components.optimizer import build_optimizer
from torchtitan_ablate.components.profiling import CommProfiler
from torchtitan_ablate.components.tokenizer import build_tokenizer
from torchtitan_ablate.components.trace_profiler import TraceProfiler
from torchtitan_ablate.components.validate import Validator
from torchtitan_ablate.config import ConfigError, JobConfig, run_main, write_config
from torchtitan_ablate.distributed import utils as dist_utils
from torchtitan_ablate.distributed.context_parallel import place_micro_batch
from torchtitan_ablate.distributed.float8 import float8_post_optimizer_step
from torchtitan_ablate.distributed.fsdp import before_micro_batch
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.models.common import attention
from torchtitan_ablate.models.common.lora import init_lora_weights
from torchtitan_ablate.models.qwen3 import Qwen3Model, Qwen3ModelArgs, qwen3_flavors
from torchtitan_ablate.models.qwen3.parallelize import parallelize_qwen3

logger = logging.getLogger("torchtitan_ablate")


def build_model_args(config: JobConfig) -> Qwen3ModelArgs:
    """The flavor's sizes with this run's overrides applied (-1 keeps the flavor's value; the
    config loader has checked the ranges). MoE knobs on a dense flavor are an error, not ignored."""
    m = config.model
    if m.name != "qwen3":
        raise ConfigError(f"model.name = {m.name!r}: only 'qwen3' is built in")
    base = _auto_flavor(config) if m.flavor == "auto" else qwen3_flavors.get(m.flavor)
    if base is None:
        raise ConfigError(f"model.flavor = {m.flavor!r}: auto or one of {', '.join(qwen3_flavors)}")
    if not base.num_experts:
        _reject_moe_knobs_on_dense(config)
    overrides: dict = {"attn_backend": m.attn_backend}
    if m.moe_aux_loss_coef >= 0:
        overrides["moe_aux_loss_coef"] = m.moe_aux_loss_coef
    if m.moe_bias_update_rate > 0:
        overrides["moe_bias_update_rate"] = m.moe_bias_update_rate
    if m.vocab_size != -1:
        overrides["vocab_size"] = m.vocab_size
    if m.n_layers != -1:
        overrides["n_layers"] = m.n_layers
    if m.num_experts != -1:
        overrides["num_experts"] = m.num_experts
    overrides["max_seq_len"] = max(base.max_seq_len, config.training.seq_len)
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as e:
        raise ConfigError(f"model.flavor = {m.flavor!r} with these overrides: {e}") from None


def _reject_moe_knobs_on_dense(config: JobConfig) -> None:
    """model.num_experts, moe_aux_loss_coef and moe_bias_update_rate on a dense flavor: the
    model has no router for them to act on. Values that mean "keep" or "off" (-1, 0) are what a
    dense model does anyway and pass (shared argument lists set moe_aux_loss_coef = 0)."""
    m = config.model
    harmless = {"num_experts": (-1,), "moe_aux_loss_coef": (-1, 0), "moe_bias_update_rate": (0,)}
    for key, ok in harmless.items():
        value = getattr(m, key)
        if value not in ok:
            raise ConfigError(
                f"model.{key} = {value} applies to MoE flavors only (e.g. debugmodel_moe, "
                f"30B-A3B) and model.flavor = {m.flavor!r} is dense: remove it (or use a MoE "
                "flavor)"
            )


def _auto_flavor(config: JobConfig) -> Qwen3ModelArgs:
    """model.flavor = "auto": the sizes of the config.json in checkpoint.initial_load_path."""
    path = config.checkpoint.initial_load_path
    if not path:
        raise ConfigError(
            "model.flavor = 'auto' needs checkpoint.initial_load_path (a folder holding "
            "config.json: an HF checkpoint or a converted DCP one)"
        )
    try:
        return hf_model_args(path)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"model.flavor = 'auto': {e}") from None


def build_parallel_dims(config: JobConfig, world_size: int) -> ParallelDims:
    p = config.parallelism
    try:
        return ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            ep=p.expert_parallel_degree,
            world_size=world_size,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def num_microbatches(config: JobConfig, dp: int) -> int:
    t = config.training
    per_micro = t.local_batch_size * dp
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_micro:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} must be a multiple of "
            f"local_batch_size * data-parallel degree = {t.local_batch_size} * {dp}"
        )
    return t.global_batch_size // per_micro


def check_layout(config: JobConfig, world_size: int) -> tuple[ParallelDims, Qwen3ModelArgs, int]:
    """Every check made before anything is built (shared by the trainer, the estimator and the
    ablation dry run): degrees vs world size, model vs degrees, batch vs data parallel."""
    pd = build_parallel_dims(config, world_size)
    model_args = build_model_args(config)
    try:
        pd.check_model(model_args.num_experts, config.training.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return pd, model_args, num_microbatches(config, pd.dp)


def build_model(
    config: JobConfig, parallel_dims: ParallelDims, model_args: Qwen3ModelArgs, device: torch.device
) -> Qwen3Model:
    """The one model-building path (training, estimation, tests): meta build, parallelize,
    materialize on `device`, initialize."""
    if model_args.attn_backend == "flash" and attention.flash_attn_module() is None:
        # Here, not inside the first (compiled) forward, where it would surface as a dynamo trace.
        raise ConfigError(attention.FLASH_MISSING)
    with torch.device("meta"):
        model = Qwen3Model(model_args)
    model = parallelize_qwen3(model, parallel_dims, config, device.type)
    model.to_empty(device=device)
    if device.type == "cpu" and parallel_dims.world_size > 1:
        dist_utils.init_weights_unsharded(model, device)
    else:
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    if config.lora.enable:
        init_lora_weights(model)
    model.train()
    return model


LossFn = Callable[[Qwen3Model, dict], torch.Tensor]


def build_loss_fn(config: JobConfig) -> LossFn:
    """loss_fn(model, micro_batch) -> this micro-batch's cross-entropy sum, as configured: the
    chunked output projection + loss (training.loss_chunk_size > 0: no full logits), else the
    loss on the logits, compiled when asked (fuses the fp32 upcast, log-softmax and gather).
    Every caller of train_step (trainer, estimator, its GPU check) gets the same loss this way."""
    chunk_size = config.training.loss_chunk_size

    def inputs(batch: dict) -> tuple:
        return batch["input_ids"], batch["positions"], batch["document_ids"]

    if chunk_size > 0:

        def chunked_loss(model: Qwen3Model, batch: dict) -> torch.Tensor:
            return model(*inputs(batch), labels_BS=batch["labels"], loss_chunk_size=chunk_size)

        return chunked_loss
    ce = cross_entropy_sum
    if config.compile.enable and "loss" in config.compile.components:
        ce = torch.compile(cross_entropy_sum)

    def plain_loss(model: Qwen3Model, batch: dict) -> torch.Tensor:
        return ce(model(*inputs(batch)), batch["labels"])

    return plain_loss


def train_step(
    model: Qwen3Model,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    parallel_dims: ParallelDims,
    batches: list[dict],
    max_norm: float,
    loss_fn: LossFn,
) -> dict:
    """One optimizer step over this rank's micro-batches (shared with the memory estimator)."""
    pd = parallel_dims
    loss_group = pd.loss_group()
    device = batches[0]["input_ids"].device
    # The loss is a sum over tokens divided by the global valid-token count, so every
    # micro-batch and rank weighs tokens equally whatever the layout.
    global_tokens = sum(num_valid_tokens(b["labels"]) for b in batches)
    global_tokens = dist_utils.all_reduce_sum(global_tokens.float(), loss_group)
    # Gradients are summed over dp*cp ranks, so the per-rank aux losses are averaged here.
    aux_scale = 1.0 / (len(batches) * pd.dp * pd.cp)
    model.set_moe_aux_loss_scale(aux_scale)
    ce_total = torch.zeros((), device=device)
    aux_total = torch.zeros((), device=device)
    balance_bias = model.args.num_experts > 0 and model.args.moe_bias_update_rate > 0
    load_before = model.expert_load().clone() if balance_bias else None
    for i, batch in enumerate(batches):
        before_micro_batch(model, i, len(batches))
        ce = loss_fn(model, batch) / global_tokens
        ce.backward()
        ce_total += ce.detach()
        aux = model.moe_aux_loss()  # logged only: its gradient rides on each MoE output
        if aux is not None:
            aux_total += aux * aux_scale
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = dist_utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    float8_post_optimizer_step(model)
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()
    if balance_bias:
        # This step's global expert load, so every rank moves its bias the same way.
        step_load = dist_utils.all_reduce_sum(model.expert_load() - load_before, loss_group)
        model.update_expert_bias(step_load)
    out = {"loss": ce_total, "grad_norm": grad_norm}
    if model.args.num_experts:
        out["moe_aux_loss"] = aux_total
    return out


class Trainer:
    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.device = dist_utils.pick_device(config.training.device)
        world_size = dist_utils.init_distributed(self.device)
        pd, self.model_args, self.grad_accum = check_layout(config, world_size)
        self.parallel_dims = pd
        pd.build_meshes(self.device.type)
        self.is_writer = torch.distributed.get_rank() == 0
        if self.is_writer:
            write_config(config, os.path.join(config.job.dump_folder, "config.toml"))

        torch.manual_seed(config.training.seed)
        if config.training.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        # 1. Tokenizer and data: each data-parallel rank reads its own shard.
        self.tokenizer = build_tokenizer(config.model.tokenizer_path)
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"model.tokenizer_path = {config.model.tokenizer_path!r} has "
                f"{self.tokenizer.vocab_size} tokens but flavor {config.model.flavor!r} has "
                f"vocab_size {self.model_args.vocab_size}; set model.vocab_size"
            )
        if self.tokenizer.vocab_size * 10 < self.model_args.vocab_size:
            logger.warning(
                f"tokenizer {config.model.tokenizer_path} has {self.tokenizer.vocab_size} tokens, "
                f"the model {self.model_args.vocab_size}: for a real run point "
                "model.tokenizer_path at the model's own tokenizer"
            )
        self.dataloader = build_dataloader(
            dataset=config.training.dataset,
            dataset_path=config.training.dataset_path,
            tokenizer=self.tokenizer,
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
            packing=config.training.packing,
            dp_rank=pd.dp_rank(),
            dp_world_size=pd.dp,
            seed=config.training.seed,
            num_workers=config.training.num_workers,
            pin_memory=self.device.type == "cuda",
            data_sharding=config.training.data_sharding,
        )

        self.validator = None
        if config.validation.enable:  # held-out data: a file error shows before the model build
            self.validator = Validator(
                config.validation, config.training, self.tokenizer, pd, self.device
            )

        # 2. Model: meta build, parallelize, materialize, initialize.
        self.model = model = build_model(config, pd, self.model_args, self.device)
        self.loss_fn = build_loss_fn(config)

        # 3. Optimizer, schedule, checkpoint, metrics.
        self.optimizer = build_optimizer([model], config.optimizer, self.device.type)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.lr_scheduler, config.training.steps
        )
        self.checkpointer = CheckpointManager(
            folder=os.path.join(config.job.dump_folder, config.checkpoint.folder),
            enable=config.checkpoint.enable,
            interval=config.checkpoint.interval,
            keep_latest_k=config.checkpoint.keep_latest_k,
            model_parts=[model],
            optimizers=[self.optimizer],
            lr_schedulers=[self.lr_scheduler],
            dataloader=self.dataloader,
            initial_load_path=config.checkpoint.initial_load_path,
            initial_load_format=config.checkpoint.initial_load_format,
            load_step=config.checkpoint.load_step,
            training_steps=config.training.steps,
            dataloader_state_shared=state_same_on_every_rank(
                config.training.data_sharding, config.training.num_workers
            ),
        )
        self.metrics = MetricsLogger(
            config.metrics,
            config.job.dump_folder,
            self.device,
            self.model_args.num_flops_per_token(config.training.seq_len),
            self.is_writer,
        )
        self.comm_profiler = CommProfiler(
            config.metrics,
            config.job.dump_folder,
            self.device,
            self.is_writer,
            config.training.steps,
        )
        rank = torch.distributed.get_rank()
        self.trace_profiler = TraceProfiler(
            config.profiling, config.job.dump_folder, rank, self.device
        )
        self.step = 0
        self.stop_requested = False
        n_params = sum(p.numel() for p in model.parameters())
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if config.job.description:
            logger.info(f"job: {config.job.description}")
        logger.info(
            f"model {config.model.flavor}: {n_params:,} parameters ({n_trainable:,} trainable); "
            f"world {world_size} "
            f"({pd}); grad accumulation {self.grad_accum}; device {self.device}"
        )

    def next_batches(self, data_iter: Iterator) -> tuple[list[dict], float]:
        """This step's micro-batches on the device, and the seconds spent waiting for them."""
        start = time.perf_counter()
        batches = []
        for _ in range(self.grad_accum):
            batches.append(place_micro_batch(next(data_iter), self.parallel_dims, self.device))
        return batches, time.perf_counter() - start

    def train_step(self, batches: list[dict]) -> dict:
        return train_step(
            self.model,
            self.optimizer,
            self.lr_scheduler,
            self.parallel_dims,
            batches,
            self.config.training.max_norm,
            self.loss_fn,
        )

    def train(self) -> list[dict]:
        config = self.config
        self.step = self.checkpointer.load()
        if self.step:
            logger.info(f"resumed from step {self.step}")
        signal.signal(signal.SIGTERM, self._on_sigterm)
        gc.disable()
        data_iter = iter(self.dataloader)
        records = []
        last = config.training.steps
        while self.step < last:
            self.step += 1
            if self.step % config.training.gc_freq == 0:
                gc.collect(1)
            batches, data_time = self.next_batches(data_iter)
            lr = self.lr_scheduler.get_last_lr()[0]
            out = self.train_step(batches)
            self.comm_profiler.step(self.step)
            self.trace_profiler.step(self.step)
            self.metrics.add_tokens(sum(b["input_ids"].numel() for b in batches), data_time)
            validate = self.validator is not None and self.validator.should_run(self.step, last)
            log_now = self.metrics.should_log(self.step, last) or validate
            if log_now:
                values = self._reduce(out, lr)
                if validate:
                    start = time.perf_counter()
                    values["validation_loss"] = self.validator.run(self.model, self.loss_fn)
                    self.metrics.exclude_time(time.perf_counter() - start)
                records.append(self.metrics.log(self.step, values))
            # Agreeing on a SIGTERM costs a collective and a host sync: only on log steps,
            # where the metrics sync anyway (a stop comes at most log_freq steps late).
            sigterm = log_now and self._stop_requested_anywhere()
            stop = self.step == config.training.exit_at_step or sigterm
            self.checkpointer.save(self.step, force=self.step == last or stop)
            if stop and self.step < last:
                saved = "checkpoint saved" if config.checkpoint.enable else "checkpointing is off"
                logger.info(f"stopping at step {self.step} ({saved})")
                break
        gc.enable()
        self.comm_profiler.close()
        self.trace_profiler.close()
        self.metrics.close()
        return records

    def _reduce(self, out: dict, lr: float) -> dict:
        """Step outputs as floats averaged over ranks (loss over dp*cp), plus expert load."""
        pd = self.parallel_dims
        group = pd.loss_group()
        values = {"loss": dist_utils.all_reduce_sum(out["loss"].clone(), group).item()}
        values["grad_norm"] = float(out["grad_norm"])
        values["lr"] = lr
        if "moe_aux_loss" in out:
            aux = dist_utils.all_reduce_sum(out["moe_aux_loss"].clone(), group)
            values["moe_aux_loss"] = aux.item()
            load_LE = dist_utils.all_reduce_sum(self.model.expert_load().clone(), group)
            self.model.reset_expert_load()
            per_layer = load_LE.max(dim=1).values / load_LE.mean(dim=1).clamp(min=1e-9)
            values["expert_load_imbalance"] = per_layer.mean().item()
            values["expert_load_max_over_mean"] = [round(x, 3) for x in per_layer.tolist()]
        return values

    def _stop_requested_anywhere(self) -> bool:
        """Whether any rank got SIGTERM: all ranks must stop (and save) at the same step."""
        if self.parallel_dims.world_size == 1:
            return self.stop_requested
        flag = torch.tensor(float(self.stop_requested), device=self.device)
        return bool(dist_utils.all_reduce_max(flag, torch.distributed.group.WORLD).item())

    def _on_sigterm(self, signum: int, frame: object) -> None:
        logger.info("SIGTERM: saving a checkpoint at the end of this step")
        self.stop_requested = True


def main(config: JobConfig) -> list[dict]:
    logging.basicConfig(
        level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING,
        format="[%(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    if config.memory_estimation.enable:
        from torchtitan_ablate.memory import estimate_main

        return estimate_main(config)
    try:
        return Trainer(config).train()
    finally:
        dist_utils.destroy_distributed()


if __name__ == "__main__":
    run_main(main)

"""The one build path below the trainer: training, estimation, bench and the ablation runner.

    layout = build_layout(config, world_size, device_type)   # checks, meshes, seed
    tokenizer, loader = build_data(config, layout, device)    # the trainer and bench only
    config = resolve_steps(config, layout, tokenizer)         # training.epochs -> steps
    run = build_run(config, layout, device)                   # model, optimizer, schedule, loss

`check_layout` (layout.py) alone makes every check that needs no process group (the ablation
dry run).
The model family is model.name's (models/registry.py): its sizes, model class and parallelize
recipe. The model is built on the meta device, parallelized by that recipe, materialized on the
device and initialized; `step.train_step(run, batches)` is the step every caller times, tracks
or trains with. `BuildOptions` holds what a tool (the memory estimator) builds differently.
"""

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.components.compile import INDUCTOR, CompileBackend
from torchtitan_ablate.components.data import build_dataloader
from torchtitan_ablate.components.data.epochs import num_epoch_steps
from torchtitan_ablate.components.objective.dpo import build_dpo_loss, count_pairs
from torchtitan_ablate.components.objective.loss import (
    check_kernel_loss,
    chunked_loss_head,
    count_valid_tokens,
    cross_entropy_sum,
    kernel_loss_head,
)
from torchtitan_ablate.components.optim.lr_scheduler import build_lr_scheduler
from torchtitan_ablate.components.optim.optimizer import (
    LocalShardAdam,
    LocalShardAdamW,
    build_optimizer,
)
from torchtitan_ablate.components.text.tokenizer import Tokenizer, build_tokenizer
from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.config.derived import compiles, resolved_loss_impl
from torchtitan_ablate.config.dpo_config import dpo_enabled
from torchtitan_ablate.distributed.fsdp import AccumulationPlan, param_dtype
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.distributed.pipeline_parallel import (
    Pipeline,
    build_pipeline,
    pipeline_loss_sum,
)
from torchtitan_ablate.distributed.pipeline_stage import ActivationMeta
from torchtitan_ablate.layout import Layout, check_layout
from torchtitan_ablate.models.common import attention
from torchtitan_ablate.models.common.init import ParamInit
from torchtitan_ablate.models.common.lora import adapters_off, init_lora_weights
from torchtitan_ablate.models.common.output_head import LossHead
from torchtitan_ablate.models.registry import get_spec

logger = logging.getLogger("torchtitan_ablate")

# The loss sum, or (sum, metric sums) where the loss reports more (DPO's rewards and log-probs).
LossFn = Callable[[nn.Module, dict], torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class BuildOptions:
    """What the build path builds differently for a tool; the defaults build the trainer's run.
    The memory estimator builds CUDA's program on fake CPU tensors with these."""

    optimizer_device_type: str | None = None
    """The device type the optimizer is chosen for (None: the build device's)."""

    compile_backend: CompileBackend = INDUCTOR
    """torch.compile's backend where the config compiles (the estimator's models Inductor on
    fake tensors, estimator/compiled.py)."""

    moe_grouped_mm: bool | None = None
    """Force the routed experts' kernel of an MoE model (None: the model picks by device and
    dtype; the estimator asks for CUDA's grouped GEMM on CPU)."""


TRAINING_BUILD = BuildOptions()  # the trainer's (and bench's, seed checkpoint's) build


@dataclass
class Run:
    """A built run: everything `step.train_step` needs."""

    parallel_dims: ParallelDims
    model_args: Any
    grad_accum: int
    model: nn.Module
    """The model, or with pipeline parallel this rank's first stage (model_parts holds all)."""
    model_parts: list[nn.Module]
    optimizer: LocalShardAdam | LocalShardAdamW
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_fn: LossFn
    accumulation: AccumulationPlan | None
    """What FSDP is told between micro-batches (None without FSDP)."""
    max_norm: float
    loss_count: Callable[[dict], torch.Tensor] = count_valid_tokens
    """A micro-batch's count that loss_fn's sum is divided by (summed over the loss group):
    valid tokens; for DPO, preference pairs."""
    reference: nn.Module | None = None
    """DPO's frozen reference copy (None otherwise, and with LoRA: adapters switched off)."""
    pipeline: Pipeline | None = None
    """The schedule over this rank's stages with pipeline parallel (None otherwise)."""

    def num_params(self) -> tuple[int, int]:
        """Parameters and trainable parameters of this rank's model parts (the whole model's
        under FSDP and TP, whose DTensors count whole; with PP its stages')."""
        params = [p for part in self.model_parts for p in part.parameters()]
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)

    def eval_loss(self, batch: dict) -> torch.Tensor | tuple[torch.Tensor, dict]:
        """loss_fn's value of a micro-batch, forward only (validation, under no_grad): with
        pipeline parallel the schedule's eval over this rank's stages, on every pp rank."""
        if self.pipeline is not None:
            return pipeline_loss_sum(self.pipeline, batch)
        return self.loss_fn(self.model, batch)


def build_layout(config: JobConfig, world_size: int, device_type: str) -> Layout:
    """check_layout, then the meshes (in the current process group) and the seed that every
    later random draw (data order aside) follows."""
    layout = check_layout(config, world_size)
    layout.parallel_dims.build_meshes(device_type)
    torch.manual_seed(config.training.seed)
    return layout


def build_data(
    config: JobConfig, layout: Layout, device: torch.device
) -> tuple[Tokenizer, torch.utils.data.DataLoader]:
    """The tokenizer and this data-parallel rank's loader; a tokenizer larger than the model's
    vocabulary is an error, a much smaller one a warning."""
    t, vocab_size = config.training, layout.model_args.vocab_size
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"model.tokenizer_path = {config.model.tokenizer_path!r} has "
            f"{tokenizer.vocab_size} tokens but flavor {config.model.flavor!r} has "
            f"vocab_size {vocab_size}; set model.vocab_size"
        )
    if tokenizer.vocab_size * 10 < vocab_size:
        logger.warning(
            f"tokenizer {config.model.tokenizer_path} has {tokenizer.vocab_size} tokens, "
            f"the model {vocab_size}: for a real run point "
            "model.tokenizer_path at the model's own tokenizer"
        )
    pd = layout.parallel_dims
    dataloader = build_dataloader(
        t,
        tokenizer,
        pd.dp_rank(),
        pd.dp,
        pin_memory=device.type == "cuda",
        max_bad_rows=config.dpo.max_bad_rows,
    )
    # After the data checks: a bad dataset path stays the only line a failed start prints.
    logger.info(f"tokenizer: {config.model.tokenizer_path} ({tokenizer.vocab_size:,} tokens)")
    return tokenizer, dataloader


def resolve_steps(
    config: JobConfig, layout: Layout, tokenizer: Tokenizer | None = None
) -> JobConfig:
    """config with training.steps derived from training.epochs (components/data/epochs.py
    counts the data, the same on every rank), logged in one line; config itself without
    epochs. The trainer asks it after build_data, the ablation plan after check_layout."""
    t = config.training
    if t.epochs is None:
        return config
    tokenizer = tokenizer or build_tokenizer(config.model.tokenizer_path)
    shards = layout.parallel_dims.dp * max(t.num_workers, 1)
    derived = num_epoch_steps(
        t, tokenizer, layout.sequences_per_step, shards, config.dpo.max_bad_rows
    )
    logger.info(derived.describe(t.epochs))
    if t.exit_at_step > derived.steps:
        raise ConfigError(
            f"training.exit_at_step = {t.exit_at_step} is after the last step (training.epochs "
            f"= {t.epochs:g} gives training.steps = {derived.steps}): use a step in "
            f"1..{derived.steps}, or -1"
        )
    return dataclasses.replace(config, training=dataclasses.replace(t, steps=derived.steps))


def build_model(
    config: JobConfig,
    parallel_dims: ParallelDims,
    model_args: Any,
    device: torch.device,
    options: BuildOptions = TRAINING_BUILD,
) -> tuple[list[nn.Module], AccumulationPlan | None]:
    """The one model-building path: meta build, parallelize (the family's recipe), materialize
    on `device`, initialize. Returns the model's parts on this rank (the model itself, or its
    pipeline stages) and FSDP's plan for the micro-batches of a step."""
    if model_args.attn_backend == "flash" and attention.flash_attn_module() is None:
        # Here, not inside the first (compiled) forward, where it would surface as a dynamo trace.
        raise ConfigError(attention.FLASH_MISSING)
    if options.moe_grouped_mm is not None and model_args.num_experts:
        model_args = dataclasses.replace(model_args, moe_grouped_mm=options.moe_grouped_mm)
    spec = get_spec(config.model.name)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    parts, accumulation = spec.parallelize(
        model, parallel_dims, config, device.type, options.compile_backend
    )
    for part in parts:
        part.to_empty(device=device)
        # Every weight from a generator seeded by (training.seed, its name), drawn whole on the
        # device and sliced: the same initial weights in every layout (models/common/init.py).
        init = ParamInit(part, config.training.seed, device)
        part.init_weights(buffer_device=device, init=init)
        if config.lora.enable:
            init_lora_weights(part, init)
        part.train()
    return parts, accumulation


def build_loss_head(config: JobConfig, options: BuildOptions = TRAINING_BUILD) -> LossHead:
    """The output head's loss, (h_BSD, weight_VD, labels_BS) -> cross-entropy sum, as
    configured by training.loss_impl (resolved by config/derived.py): chunked (loss_chunk_size
    tokens at a time), liger or cce (no full logits; components/objective/loss.py), or plain:
    the loss of the whole logits. compile.components "loss" compiles the chunked and plain
    losses (fuses the fp32 upcast, log-softmax and gather); liger and cce are Triton kernels."""
    t = config.training
    impl = resolved_loss_impl(t)
    compiled = compiles(config.compile, "loss")
    if impl == "plain":
        ce = cross_entropy_sum
        if compiled:
            ce = torch.compile(cross_entropy_sum, backend=options.compile_backend)
        return lambda h_BSD, weight_VD, labels_BS: ce(F.linear(h_BSD, weight_VD), labels_BS)
    if impl == "chunked":
        return chunked_loss_head(t.loss_chunk_size, compiled, options.compile_backend)
    check_kernel_loss(impl)
    return kernel_loss_head(impl)


def build_loss_fn(config: JobConfig, options: BuildOptions = TRAINING_BUILD) -> LossFn:
    """loss_fn(model, micro_batch) -> this micro-batch's cross-entropy sum: the model's output
    head runs build_loss_head's loss."""
    head = build_loss_head(config, options)

    def head_loss(model: nn.Module, batch: dict) -> torch.Tensor:
        inputs = batch["input_ids"], batch["positions"], batch["document_ids"]
        return model(*inputs, labels_BS=batch["labels"], loss_head=head)

    return head_loss


def build_run(
    config: JobConfig,
    layout: Layout,
    device: torch.device,
    options: BuildOptions = TRAINING_BUILD,
) -> Run:
    """Model, optimizer, LR schedule and loss on the layout's meshes (the estimator calls it
    under its FakeTensorMode, after build_layout: DeviceMesh needs real rank tensors)."""
    parts, accumulation = build_model(
        config, layout.parallel_dims, layout.model_args, device, options
    )
    model = parts[0]
    optimizer_device_type = options.optimizer_device_type or device.type
    optimizer = build_optimizer(parts, config.optimizer, optimizer_device_type)
    lr_scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    if dpo_enabled(config):  # the pair loss and its reference model
        loss = _build_dpo(config, layout, device, model, options)
    else:
        loss = dict(loss_fn=build_loss_fn(config, options))
    pd = layout.parallel_dims
    if pd.pp_enabled:
        head = build_loss_head(config, options)
        n_layers, batch = layout.model_args.n_layers, config.training.local_batch_size
        # Under context parallel a part sees only its cp rank's zigzag slice of the sequence,
        # under tensor parallel the hidden states only its tp rank's part of that.
        meta = ActivationMeta(
            config.parallelism.pipeline_parallel_microbatch_size,
            config.training.seq_len // pd.cp,
            layout.model_args.dim,
            param_dtype(config.training, device.type),
            tp=pd.tp,
        )
        loss["pipeline"] = build_pipeline(
            parts, config.parallelism, n_layers, batch, pd.mesh("pp"), device, head, meta
        )
    return Run(
        parallel_dims=layout.parallel_dims,
        model_args=layout.model_args,
        grad_accum=layout.grad_accum,
        model=model,
        model_parts=parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        accumulation=accumulation,
        max_norm=config.training.max_norm,
        **loss,
    )


def _build_dpo(
    config: JobConfig,
    layout: Layout,
    device: torch.device,
    model: nn.Module,
    options: BuildOptions,
) -> dict:
    """Run's DPO fields: the pair loss, the pair count, and the reference model (a second
    model built and sharded like the policy; with LoRA none: the policy with adapters off)."""
    reference = None
    if not config.lora.enable:
        [reference], _ = build_model(
            config, layout.parallel_dims, layout.model_args, device, options
        )
    t = config.training
    chunk = t.loss_chunk_size if resolved_loss_impl(t) == "chunked" else 0
    loss_fn = build_dpo_loss(
        config.dpo, chunk, layout.parallel_dims, model, reference, adapters_off
    )
    return dict(loss_fn=loss_fn, loss_count=count_pairs, reference=reference)

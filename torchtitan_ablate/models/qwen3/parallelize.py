"""parallelize_qwen3: the one place where techniques are applied to a meta-device Qwen3Model.

The order is fixed and matters:
PP. pipeline parallel before everything: it cuts the model into this rank's stages (copies
   keeping their own modules under their original names), and every step below then applies to
   each stage as to a whole model (its own FSDP root, its blocks AC'd and compiled), so none of
   them needs to know about stages. Each stage is then materialized and initialized by the build
   path like a whole model; expert parallel shards each part's experts over its own ep ranks,
   context parallel gives each part its cp rank's slice of the sequence, and tensor parallel
   splits each part's weights over its tp ranks (the parts pass each other their tp rank's
   sequence slice of the hidden states). LoRA adapts and float8 converts each part's own
   blocks.
0. LoRA first (when enabled): it adds the adapter parameters that EP and FSDP must shard like
   their base weights, and its adapted projections are no longer nn.Linear, so float8 leaves
   them (frozen base included) in high precision instead of dropping the adapters.
1. float8: later wrappers must see the final module types.
2. tensor parallel, first of the parallelisms (as torchtitan): it replaces the Linear weights
   with DTensors split over the tp ranks and hooks their inputs and outputs; everything after
   it (checkpoint wrappers, compiled blocks, FSDP's sharding of those DTensors over the dp ranks
   as a 2-D layout) must see the final parameters and hooks. With float8 (tensorwise; rowwise
   is refused with TP) the converted linears take torchao's float8 TP styles, as torchtitan:
   the TP all-gathers move float8 and the scales cover the whole tensors (on CUDA; gloo
   cannot move float8, so CPU keeps the plain styles, same scales). LoRA with TP is
   refused (TP's styles split nn.Linear, which LoRA's adapted projections no longer are).
   MoE layers are not split: each tp rank routes its own sequence shard through experts that
   EP (step 3) and FSDP (over efsdp, which counts the tp ranks) place as without TP.
   With TP, FSDP is applied even over one dp rank (step 7).
3. expert parallel: installs token dispatch/combine around the routed experts.
4. context parallel: wraps attention so it sees every key/value of the sharded sequence. After
   TP: its attention core runs on TP's plain per-rank heads, inside TP's hooks.
5. activation checkpointing: wraps whole blocks, so it goes after the modules inside them.
6. torch.compile per block: after AC (the checkpoint is compiled with the block; MoE blocks,
   whose graphs break, are compiled inside it) and before FSDP, so FSDP's hooks stay outside
   the compiled graphs.
7. FSDP2 / HSDP last: it shards whatever parameters the steps above left in place.
"""

import logging

import torch
import torch.nn as nn

from torchtitan_ablate.components.compile import INDUCTOR, CompileBackend, apply_compile
from torchtitan_ablate.components.quantization.float8 import apply_float8
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.config.derived import compiles, resolved_reshard_after_forward
from torchtitan_ablate.config.job_config import JobConfig
from torchtitan_ablate.config.pipeline_rules import SPLIT_BACKWARD
from torchtitan_ablate.distributed.activation_checkpoint import apply_ac
from torchtitan_ablate.distributed.async_tensor_parallel import apply_async_tp
from torchtitan_ablate.distributed.context_parallel import apply_cp
from torchtitan_ablate.distributed.ep_token_dispatch import TokenDispatch
from torchtitan_ablate.distributed.expert_parallel import RowDispatch, apply_ep
from torchtitan_ablate.distributed.float8_tensor_parallel import float8_tp_styles
from torchtitan_ablate.distributed.fsdp import (
    AccumulationPlan,
    apply_fsdp,
    describe_layout,
    param_dtype,
)
from torchtitan_ablate.distributed.parallel_dims import ParallelDims
from torchtitan_ablate.distributed.pipeline_parallel import plan_stages, split_stages, stage_ids
from torchtitan_ablate.distributed.tensor_parallel import PLAIN, apply_tp
from torchtitan_ablate.models.common.lora import apply_lora
from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs

logger = logging.getLogger("torchtitan_ablate")


def tp_split_sizes(args: Qwen3ModelArgs) -> dict[str, int]:
    """The sizes apply_tp splits over the tp ranks: query and kv heads (each rank holds whole
    heads, and its query heads' kv heads), the dense FFN width (when a layer is dense: MoE
    layers are not split), and the vocabulary (embedding and output head rows)."""
    names = ["n_heads", "n_kv_heads", "vocab_size"]
    if not all(args.is_moe_layer(i) for i in range(args.n_layers)):
        names.append("hidden_dim")
    return {name: getattr(args, name) for name in names}


def check_fsdp_knobs(job_config: JobConfig, device_type: str, use_fsdp: bool) -> None:
    """FSDP settings that would be silently ignored, or break the pipeline's split backward, are
    errors, raised before anything is built.

    Without FSDP (one rank, float32 parameters) parameters stay whole and gradients are not
    reduced: cpu offload and bf16 reduction cannot happen, and "always" cannot free anything
    ("never", keeping parameters gathered, is what happens anyway).
    """
    p, t = job_config.parallelism, job_config.training
    split = p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule in SPLIT_BACKWARD
    if use_fsdp and split and resolved_reshard_after_forward(p) != "never":
        # The weight pass would find no gradient for a block resharded after its forward.
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r} with "
            f"FSDP needs parallelism.fsdp_reshard_after_forward = 'default' or 'never' (it is "
            f"{p.fsdp_reshard_after_forward!r}): its split backward lists the weights before "
            "FSDP re-gathers the blocks it resharded after forward, which then get no gradient"
        )
    if p.fsdp_cpu_offload and device_type != "cuda":
        raise ConfigError(
            "parallelism.fsdp_cpu_offload = true needs CUDA devices (it keeps GPU parameters "
            "in CPU memory); on CPU training set it to false"
        )
    if use_fsdp:
        return
    dtype_reason = (
        "training.mixed_precision_param = 'float32'"
        if t.mixed_precision_param == "float32"
        else "CPU training keeps float32 unless training.cpu_mixed_precision = true"
    )
    why = f"needs FSDP, which is not applied on one rank with float32 parameters ({dtype_reason})"
    if p.fsdp_cpu_offload:
        raise ConfigError(
            f"parallelism.fsdp_cpu_offload = true {why}: set training.mixed_precision_param = "
            "'bfloat16' (FSDP then runs on one GPU too) or fsdp_cpu_offload = false"
        )
    if p.fsdp_reshard_after_forward == "always":
        raise ConfigError(
            f"parallelism.fsdp_reshard_after_forward = 'always' {why}; without it parameters "
            "stay whole and nothing is freed after forward: remove the setting or use more ranks"
        )
    if t.mixed_precision_reduce != "float32":
        raise ConfigError(
            f"training.mixed_precision_reduce = {t.mixed_precision_reduce!r} {why}; one rank "
            "reduces no gradients: remove the setting or use more ranks"
        )


def parallelize_qwen3(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device_type: str,
    compile_backend: CompileBackend = INDUCTOR,
) -> tuple[list[nn.Module], AccumulationPlan | None]:
    """Returns this rank's model parts (the model itself, or its pipeline stages), each
    parallelized in place, and FSDP's plan for the micro-batches of a step, which the train step
    hands to `before_micro_batch` (None without FSDP, and with PP, whose stages tell FSDP which
    micro-batch is the last themselves).

    compile_backend: torch.compile's backend for the blocks (the memory estimator's models
    Inductor on fake tensors)."""
    pd = parallel_dims
    if not pd.pp_enabled:
        return [model], _parallelize_part(model, pd, job_config, device_type, compile_backend)
    p = job_config.parallelism
    fqns = plan_stages(p, model.args.n_layers)
    parts = split_stages(model, fqns, stage_ids(p, pd.pp_rank(), len(fqns)))
    for part in parts:
        _parallelize_part(part, pd, job_config, device_type, compile_backend)
    logger.info(
        f"pipeline parallel: {len(fqns)} stages over {pd.pp} ranks ({p.pipeline_parallel_schedule})"
    )
    return parts, None


def _parallelize_part(
    model: nn.Module,
    pd: ParallelDims,
    job_config: JobConfig,
    device_type: str,
    compile_backend: CompileBackend,
) -> AccumulationPlan | None:
    """Steps 0 to 7 on the whole model or on one pipeline stage."""
    dtype = param_dtype(job_config.training, device_type)
    # FSDP2 also on one GPU: its MixedPrecisionPolicy gives bf16 compute over fp32 weights. And
    # with TP on one dp rank: it sums the replicated weights' pending (Partial) tp gradients.
    use_fsdp = pd.dp > 1 or pd.cp > 1 or pd.tp > 1 or dtype != torch.float32
    check_fsdp_knobs(job_config, device_type, use_fsdp)

    lora = job_config.lora
    if lora.enable:
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)

    if job_config.float8.enable:
        apply_float8(model, job_config.float8, device_type, fsdp_enabled=use_fsdp)

    if pd.tp_enabled:
        # float8 (tensorwise only, config rules): torchao's float8 styles for Float8Linears.
        styles = float8_tp_styles(device_type) if job_config.float8.enable else (PLAIN, None)
        apply_tp(model, pd.mesh("tp"), *styles)
        if job_config.parallelism.enable_async_tensor_parallel:
            apply_async_tp(pd.mesh("tp"), device_type)  # before compile (step 5)
        logger.info(f"tensor parallel: weights split over {pd.tp} ranks (sequence parallel)")

    if pd.ep_enabled:
        tokens = job_config.parallelism.expert_parallel_dispatch == "tokens"
        apply_ep(model, pd.mesh("ep"), TokenDispatch if tokens else RowDispatch)
        logger.info(f"expert parallel: experts split over {pd.ep} ranks, sharded over {pd.efsdp}")

    if pd.cp_enabled:
        apply_cp(model, pd.mesh("cp"))
        logger.info(f"context parallel: sequence split over {pd.cp} ranks (head-tail chunks)")

    ac = job_config.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
        option = f" ({ac.selective_ac_option})" if ac.mode == "selective" else ""
        logger.info(f"activation checkpointing: {ac.mode}{option}")

    if compiles(job_config.compile, "model"):
        # MoE blocks read token counts on the host (expert parallel's split sizes, the CPU
        # expert loop): graph breaks allowed, and compiled inside a whole-block checkpoint.
        op_policy = ac.mode == "selective" and ac.selective_ac_option == "op"
        apply_compile(model, not model.args.num_experts, compile_backend, op_policy=op_policy)
        logger.info("torch.compile per transformer block")

    plan = None
    experts_own_mesh = pd.experts_mesh_enabled and bool(model.args.num_experts)
    if use_fsdp:
        p = job_config.parallelism
        plan = apply_fsdp(
            model,
            pd.mesh("fsdp"),
            param_dtype=dtype,
            reduce_dtype=getattr(torch, job_config.training.mixed_precision_reduce),
            reshard_after_forward=resolved_reshard_after_forward(p),
            cpu_offload=p.fsdp_cpu_offload,
            # With TP too: the tp ranks route different tokens through the same experts.
            experts_mesh=pd.mesh("experts_fsdp") if experts_own_mesh else None,
        )
        logger.info(describe_layout(pd.dp_replicate, pd.dp_shard * pd.cp))
    return plan

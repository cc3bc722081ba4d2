"""One optimizer step of a built run: the step the trainer trains with, bench times and the
memory estimator tracks."""

from collections.abc import Callable, Iterator

import torch

from torchtitan_ablate.build import Run
from torchtitan_ablate.components.objective.finite import StepValues
from torchtitan_ablate.components.objective.loss import num_valid_tokens
from torchtitan_ablate.components.quantization.float8 import float8_post_optimizer_step
from torchtitan_ablate.components.rank_moe import RankMoE
from torchtitan_ablate.distributed import utils as dist_utils
from torchtitan_ablate.distributed.context_parallel import place_micro_batch
from torchtitan_ablate.distributed.fsdp import before_micro_batch
from torchtitan_ablate.distributed.pipeline_parallel import pipeline_forward_backward


def next_micro_batches(
    data_iter: Iterator,
    run: Run,
    device: torch.device,
    on_host: Callable[[dict], None] | None = None,
) -> list[dict]:
    """This step's micro-batches from the loader, each this rank's CP slice on the device.
    on_host(batch): sees each whole loader batch on the host first (the trainer counts the
    attention work of its documents there, without a device sync)."""
    batches = []
    for _ in range(run.grad_accum):
        batch = next(data_iter)
        if on_host is not None:
            on_host(batch)
        batches.append(place_micro_batch(batch, run.parallel_dims, device))
    return batches


def train_step(run: Run, batches: list[dict], guard_nonfinite: bool = False) -> dict:
    """One optimizer step over this rank's micro-batches: loss, grad_norm, tokens (the global
    count of tokens the loss counts), moe_aux_loss for MoE models, and loss_metrics (the loss
    function's own, e.g. DPO's rewards, normalised as the loss; {} for the token loss).

    guard_nonfinite (the trainer's): a step whose global loss or gradient norm is NaN/Inf does
    not update the weights, the optimizer state or the expert bias; out["check"] (StepValues)
    brings that verdict and the token count to the host, alike on every rank. With a fused
    optimizer the update is skipped on the device and nothing here waits for the GPU (the
    trainer reads the values once the next step is queued); otherwise they are read here, one
    host sync. Costs a scalar all-reduce, so bench and the memory estimator leave it off."""
    model, pd = run.model, run.parallel_dims
    loss_group = pd.loss_group()
    device = batches[0]["input_ids"].device
    # The loss is a sum divided by its global count (valid tokens; DPO: preference pairs), so
    # every micro-batch and rank weighs them equally whatever the layout. One all-reduce
    # brings that count and the token count.
    counts = sum(torch.stack([num_valid_tokens(b["labels"]), run.loss_count(b)]) for b in batches)
    global_tokens, global_count = dist_utils.all_reduce_sum(counts.float(), loss_group)
    # Gradients are summed over dp*cp*tp ranks (tp: sequence parallel hands each its own tokens
    # to route) and over the forwards of a step (micro-batches, and the pipeline's within each),
    # so the per-forward aux losses are averaged here.
    moe = RankMoE(run.model_parts)
    forwards = len(batches) * (run.pipeline.n_microbatches if run.pipeline is not None else 1)
    aux_scale = 1.0 / (forwards * pd.num_loss_ranks)
    moe.set_aux_loss_scale(aux_scale)
    ce_total = torch.zeros((), device=device)
    aux_total = torch.zeros((), device=device)
    balance_bias = model.args.num_experts > 0 and model.args.moe_bias_update_rate > 0
    load = moe.expert_load() if balance_bias else None  # None on a stage without MoE layers
    load_before = load.clone() if load is not None else None
    metrics: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(batches):
        if run.pipeline is not None:  # the schedule runs the batch's micro-batches and backward
            ce_total += pipeline_forward_backward(run.pipeline, batch, global_count)
            # Logged: each layer keeps its last forward's aux loss, the batch's last
            # micro-batch's here, standing for the batch's (the gradient has them all).
            aux = moe.aux_loss()
            if aux is not None:
                aux_total += aux * aux_scale * run.pipeline.n_microbatches
            continue
        before_micro_batch(model, run.accumulation, i, len(batches))
        loss = run.loss_fn(model, batch)
        loss, loss_metrics = loss if isinstance(loss, tuple) else (loss, {})
        ce = loss / global_count
        ce.backward()
        ce_total += ce.detach()
        for name, value in loss_metrics.items():
            metrics[name] = metrics.get(name, 0) + value / global_count
        aux = moe.aux_loss()  # logged only: its gradient rides on each MoE output
        if aux is not None:
            aux_total += aux * aux_scale
    params = [p for part in run.model_parts for p in part.parameters() if p.requires_grad]
    grad_norm = dist_utils.clip_grad_norm_(params, run.max_norm, pd.pp_group())
    # Whether the step updates: decided on the host (read now), or with a fused optimizer on
    # the device (the trainer reads the values later).
    check = None
    if guard_nonfinite:
        loss_sum = dist_utils.all_reduce_sum(ce_total.clone(), loss_group)
        check = StepValues(loss_sum, grad_norm, global_tokens)
        if not run.optimizer.skips_on_device:
            check.read()  # now, while the stream is drained by it, not after the optimizer's launch
    on_device = check is not None and not check.is_read
    update = check is None or on_device or check.read()[0] is None
    if on_device:
        run.optimizer.step_unless(check.nonfinite)
    elif update:
        run.optimizer.step()
    if update:  # a step skipped on the device leaves the weights, so their scales, unchanged
        for part in run.model_parts:
            float8_post_optimizer_step(part)
    run.optimizer.zero_grad(set_to_none=True)
    # The schedule follows the step number, updated or not (a resume restores only the step).
    run.lr_scheduler.step()
    if load_before is not None and update:
        # This step's global expert load, so every rank moves its bias the same way.
        step_load = dist_utils.all_reduce_sum(moe.expert_load() - load_before, loss_group)
        if on_device:
            step_load = step_load * ~check.nonfinite  # a zero load moves no bias
        moe.update_expert_bias(step_load)
    out = {"loss": ce_total, "grad_norm": grad_norm, "check": check}
    out["loss_metrics"] = metrics
    if model.args.num_experts:
        out["moe_aux_loss"] = aux_total
    return out

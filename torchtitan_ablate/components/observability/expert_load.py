"""The MoE metrics of a logged step: the aux loss and how evenly the routers spread tokens."""

import torch
from torch import nn

from torchtitan_ablate.distributed import utils as dist_utils


def moe_step_metrics(
    model: nn.Module, aux_loss: torch.Tensor, group: torch.distributed.ProcessGroup | None
) -> dict:
    """moe_aux_loss summed over the loss group, and per layer the busiest expert's load over
    the mean load (counts summed over the group since the last logged step, then reset):
    expert_load_imbalance is their mean, expert_load_max_over_mean the list."""
    values = {"moe_aux_loss": dist_utils.all_reduce_sum(aux_loss.clone(), group).item()}
    load_LE = dist_utils.all_reduce_sum(model.expert_load().clone(), group)
    model.reset_expert_load()
    per_layer = load_LE.max(dim=1).values / load_LE.mean(dim=1).clamp(min=1e-9)
    values["expert_load_imbalance"] = per_layer.mean().item()
    values["expert_load_max_over_mean"] = [round(x, 3) for x in per_layer.tolist()]
    if model.args.moe_force_load_balance:
        values["moe_force_load_balance"] = True
    return values

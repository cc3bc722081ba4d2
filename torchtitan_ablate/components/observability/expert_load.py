"""The MoE metrics of a logged step: the aux loss and how evenly the routers spread tokens."""

import torch

from torchtitan_ablate.components.rank_moe import RankMoE
from torchtitan_ablate.distributed import utils as dist_utils


def moe_step_metrics(
    moe: RankMoE,
    args: object,
    aux_loss: torch.Tensor,
    group: torch.distributed.ProcessGroup | None,
    pp_group: torch.distributed.ProcessGroup | None = None,
) -> dict:
    """moe_aux_loss summed over the loss group (and the pp ranks, which hold different layers),
    and per layer the busiest expert's load over the mean load (counts summed over the group
    since the last logged step, then reset): expert_load_imbalance is their mean,
    expert_load_max_over_mean the list, every layer's in layer order. args: the model args."""
    aux = dist_utils.all_reduce_sum(dist_utils.all_reduce_sum(aux_loss.clone(), group), pp_group)
    values = {"moe_aux_loss": aux.item()}
    load_LE = moe.global_load(args.n_layers, args.num_experts, group, pp_group, aux.device)
    moe.reset_expert_load()
    per_layer = load_LE.max(dim=1).values / load_LE.mean(dim=1).clamp(min=1e-9)
    values["expert_load_imbalance"] = per_layer.mean().item()
    values["expert_load_max_over_mean"] = [round(x, 3) for x in per_layer.tolist()]
    if args.moe_force_load_balance:
        values["moe_force_load_balance"] = True
    return values

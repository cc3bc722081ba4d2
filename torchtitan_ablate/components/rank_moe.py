"""The MoE hooks of one rank's model parts: the whole model, or its pipeline stages.

The train step and the metrics reach this rank's MoE layers through `RankMoE`, which calls each
part's own hooks (the family contract, models/spec.py): with pipeline parallel a rank holds some
blocks only (one stage or several), so the aux-loss scale, the aux loss, the expert load and the
bias update cover those parts' layers, and the logs gather every layer over the pp ranks
(`global_load`). Without PP there is one part and the hooks are the model's own.
"""

import torch
from torch import nn
from torch.distributed import ProcessGroup

from torchtitan_ablate.distributed import utils as dist_utils


class RankMoE:
    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        self.moe = parts[0].args.num_experts > 0

    def set_aux_loss_scale(self, scale: float) -> None:
        """Weight of each forward's aux-loss gradient: 1 / (forwards per step * dp * cp * tp),
        since gradients are summed over micro-batches (and pipeline micro-batches) and ranks."""
        for part in self.parts:
            part.set_moe_aux_loss_scale(scale)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum over this rank's MoE layers of the last forward's aux loss (detached), or None."""
        losses = [a for a in (part.moe_aux_loss() for part in self.parts) if a is not None]
        return torch.stack(losses).sum() if losses else None

    def expert_load(self) -> torch.Tensor | None:
        """Tokens routed to each expert since the last reset, [this rank's MoE layers, E] in the
        parts' order (None: no MoE layer here)."""
        loads = [part.expert_load() for part in self.parts] if self.moe else []
        loads = [load for load in loads if load is not None]
        return torch.cat(loads) if loads else None

    def reset_expert_load(self) -> None:
        for part in self.parts if self.moe else []:
            part.reset_expert_load()

    def update_expert_bias(self, load_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing step on this rank's MoE layers from their loads [L, E] (summed
        over the data-parallel ranks first, or the ranks' biases drift apart)."""
        start = 0
        for part in self.parts:
            n = len(part.moe_layer_ids())
            if n:
                part.update_expert_bias(load_LE[start : start + n])
            start += n

    def global_load(
        self,
        n_layers: int,
        num_experts: int,
        dp_group: ProcessGroup | None,
        pp_group: ProcessGroup | None,
        device: torch.device,
    ) -> torch.Tensor:
        """Every MoE layer's load since the last reset [n_moe_layers, E], summed over the
        data-parallel ranks, in layer order, on every rank: with PP this rank's rows placed by
        layer index and summed over the pp ranks (each layer lives on one)."""
        load_LE = self.expert_load()
        if pp_group is None:
            return dist_utils.all_reduce_sum(load_LE.clone(), dp_group)
        rows = torch.zeros(n_layers, num_experts + 1, device=device)
        if load_LE is not None:
            ids = [i for part in self.parts for i in part.moe_layer_ids()]
            index = torch.tensor(ids, device=device, dtype=torch.long)
            rows[index, :-1] = load_LE.to(rows.dtype)
            rows[index, -1] = 1.0  # marks the MoE layers
        rows = dist_utils.all_reduce_sum(rows, dp_group)
        rows = dist_utils.all_reduce_sum(rows, pp_group)
        return rows[rows[:, -1] > 0, :-1]

"""Tensor parallel styles for LoRA's linears (models/common/lora.py's LoRALinear: a frozen weight
W [out, in] and its adapter's factors A [r, in], B [out, r]; y = x W^T + scale * x A^T B^T).

Each is split as one linear, its factors placed so that the adapter's output comes out sharded
as the base output does, and adds to it before the row-split linears' reduce-scatter:
- column-split (wq / wk / wv, gate / up): W and B by output rows, A replicated. The input is
  the all-gathered sequence, so x A^T is whole on every rank; A's gradient is each rank's share
  of a sum over the output columns (partial), which FSDP sums over tp like the norms' weights.
- row-split (wo, down): W and A by input columns, so x A^T is a partial sum like x W^T; B
  replicated, applied to that partial sum, whose reduce-scatter then carries both outputs.

tensor_parallel.py's block plan gives LoRALinear modules these styles (TPStyles LORA).
"""

import functools
from typing import cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class _LoRAStyle:
    """A LoRALinear (models/common/lora.py: weight, lora_a, lora_b) split as one linear, its
    adapter's factors placed so that x A^T B^T comes out as x W^T does (`placements`)."""

    placements: dict[str, Placement]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Colwise/RowwiseParallel._apply partitions nn.Linear and nn.Embedding only.
        style = cast(ColwiseParallel, self)
        return distribute_module(
            module,
            device_mesh,
            self._partition_lora,
            functools.partial(
                style._prepare_input_fn, style.input_layouts, style.desired_input_layouts
            ),
            functools.partial(
                style._prepare_output_fn, style.output_layouts, style.use_local_output
            ),
        )

    def _partition_lora(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name:  # distribute_module visits the submodules too: the dropout holds nothing
            return
        src = cast(ColwiseParallel, self).src_data_rank
        for key, placement in self.placements.items():
            param = getattr(module, key)
            dist_param = distribute_tensor(param, device_mesh, [placement], src_data_rank=src)
            module.register_parameter(key, nn.Parameter(dist_param, param.requires_grad))


class LoRAColwiseParallel(_LoRAStyle, ColwiseParallel):
    """Output columns split: W and B by rows; A [r, in] replicated (its gradient, each rank's
    share of the sum over output columns, is partial, and FSDP sums it over tp)."""

    placements = {"weight": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)}


class LoRARowwiseParallel(_LoRAStyle, RowwiseParallel):
    """Input rows split: W and A by columns, so x A^T is a partial sum like x W^T and both
    reduce-scatter as one output; B [out, r] replicated."""

    placements = {"weight": Shard(1), "lora_a": Shard(1), "lora_b": Replicate()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # RowwiseParallel sets it in its own _apply: a linear's input sharded on the last dim.
        self.desired_input_layouts = (Shard(-1),)
        return super()._apply(module, device_mesh)

"""Reading any region of our stacked routed-expert weights (moe.experts.w1 / w3 [E, I, D],
w2 [E, D, I]) from a Qwen3-MoE HF checkpoint, without materialising more than the region.

"hub": one 2-D tensor per expert (mlp.experts.{e}.{gate,up,down}_proj.weight): only the experts
of the region are read. "fused" (transformers 5.x): mlp.experts.gate_up_proj [E, 2I, D] with the
gate first, and mlp.experts.down_proj [E, D, I]: the region is one slice of them.

Shape legend: E experts, I expert hidden dim, D model dim.
"""

from collections.abc import Callable

import torch

from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs
from torchtitan_ablate.models.spec import ReadHF, Region

HUB_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_shape(w: str, args: Qwen3ModelArgs) -> tuple[int, int, int]:
    e, i, d = args.num_experts, args.moe_hidden_dim, args.dim
    return (e, d, i) if w == "w2" else (e, i, d)


def expert_reader(
    prefix: str, w: str, args: Qwen3ModelArgs, layout: str, read: ReadHF
) -> Callable[[Region], torch.Tensor]:
    """Regions of expert weight `w` ("w1", "w2", "w3") of the block whose HF names start with
    `prefix` (model.layers.N.)."""
    if layout == "hub":

        def read_hub(region: Region) -> torch.Tensor:
            experts = range(args.num_experts)[region[0]]
            name = HUB_EXPERT[w]
            parts = [read(f"{prefix}mlp.experts.{e}.{name}.weight", region[1:]) for e in experts]
            if parts:
                return torch.stack(parts)
            rest = [len(range(n)[r]) for n, r in zip(expert_shape(w, args)[1:], region[1:])]
            return torch.empty(0, *rest)

        return read_hub
    if w == "w2":
        return lambda region: read(prefix + "mlp.experts.down_proj", region)
    shift = 0 if w == "w1" else args.moe_hidden_dim  # gate_up_proj = [gate; up] along dim 1

    def read_fused(region: Region) -> torch.Tensor:
        rows = range(args.moe_hidden_dim)[region[1]]
        fused_rows = slice(rows.start + shift, rows.stop + shift)
        return read(prefix + "mlp.experts.gate_up_proj", (region[0], fused_rows, region[2]))

    return read_fused

"""ParallelDims: the parallel degrees of a run and the only place DeviceMeshes are made.

Layout: one world mesh (pp, dp_replicate, dp_shard, cp, tp) for dense parameters, tp innermost
and pp outermost (as torchtitan): a tp group is a block of consecutive ranks, the ones that talk
every layer, which on a multi-GPU node keeps them on one host's fast links; the pipeline
stages, which exchange one activation per micro-batch, are the farthest apart. Every other mesh
has pp as its outer dimension too, so each stage's data/tensor parallel groups are separate.
Expert parallel borrows its ranks from dp_shard * cp, so experts live on a second view of the
same ranks, (pp, dp_replicate, efsdp, ep) with efsdp = dp_shard * cp * tp / ep: the ranks that
hold copies of the same experts, over which FSDP shards them and sums their gradients. An ep
group is a block of consecutive dp_shard * cp ranks of one tp coordinate (with PP inside one
pipeline stage's ranks, which all run the same schedule, so their all-to-alls pair up). Under
tensor parallel's sequence parallel the tp ranks hold different tokens, which the MoE layers
route as their own (tensor_parallel.py), so for the experts the tp ranks are more data-parallel
ranks: efsdp takes them in, and that view is built (from an explicit rank grid, as its efsdp
dim is not adjacent in the world order) whenever ep > 1 or tp > 1.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelDimsError(ValueError):
    """Degrees that cannot form a mesh; raised before any process-group work."""


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int
    tp: int = 1
    pp: int = 1
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "ep", "tp", "pp", "world_size"):
            if getattr(self, name) < 1:
                raise ParallelDimsError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.dp_shard == -1:
            rest = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % rest:
                raise ParallelDimsError(
                    f"world size {self.world_size} is not divisible by pipeline_parallel_degree "
                    f"* data_parallel_replicate_degree * context_parallel_degree * "
                    f"tensor_parallel_degree = {self.pp} * {self.dp_replicate} * {self.cp} * "
                    f"{self.tp}"
                )
            self.dp_shard = self.world_size // rest
        if self.dp_shard < 1:
            raise ParallelDimsError(f"data_parallel_shard_degree = {self.dp_shard}: >= 1 or -1")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ParallelDimsError(
                f"pipeline_parallel_degree * data_parallel_replicate_degree * "
                f"data_parallel_shard_degree * context_parallel_degree * tensor_parallel_degree "
                f"= {self.pp} * {self.dp_replicate} * {self.dp_shard} * {self.cp} * {self.tp} = "
                f"{product}, but the world size is {self.world_size}"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ParallelDimsError(
                f"expert_parallel_degree = {self.ep} must divide data_parallel_shard_degree * "
                f"context_parallel_degree = {self.dp_shard} * {self.cp} (EP borrows those ranks)"
            )

    def check_model(
        self, num_experts: int, seq_len: int, tp_split: dict[str, int] | None = None
    ) -> None:
        """Constraints that need the model and batch shape, checked here only: the build path
        calls this before anything is built, so apply_ep, apply_tp, cp_shard_batch and
        tp_shard_labels take them as met. tp_split: the model sizes tensor parallel splits
        ({"n_heads": 16, ...}), each of which tp must divide."""
        if self.ep > 1 and (num_experts == 0 or num_experts % self.ep):
            raise ParallelDimsError(
                f"expert_parallel_degree = {self.ep} must divide the number of experts "
                f"({num_experts}); dense models need expert_parallel_degree = 1"
            )
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ParallelDimsError(
                f"training.seq_len = {seq_len} must be divisible by 2 * context_parallel_degree "
                f"= {2 * self.cp} (head-tail load balancing splits it into 2 * cp chunks)"
            )
        if self.tp == 1:
            return
        key = f"tensor_parallel_degree = {self.tp}"
        # Sequence parallel splits each cp rank's sequence (already a whole 2 * cp chunks).
        seq_name = "training.seq_len"
        if self.cp > 1:
            seq_name = f"training.seq_len / context_parallel_degree = {seq_len} / {self.cp}"
        sizes = {
            seq_name: seq_len // self.cp,
            **{f"model {k}": v for k, v in (tp_split or {}).items()},
        }
        for name, size in sizes.items():
            if size % self.tp:
                raise ParallelDimsError(
                    f"{key} must divide {name} = {size} (tensor parallel splits it evenly)"
                )

    # Degrees and switches.
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed per micro-step."""
        return self.dp_replicate * self.dp_shard

    @property
    def num_loss_ranks(self) -> int:
        """Ranks that hold different tokens of one step and so share its loss: dp x cp x tp
        (context and tensor parallel ranks each hold their own slice of the sequence)."""
        return self.dp * self.cp * self.tp

    @property
    def efsdp(self) -> int:
        """Shard degree of routed experts: the dp_shard * cp * tp ranks left after EP (tp
        ranks route their own sequence slices, so they hold copies of the same experts)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def experts_mesh_enabled(self) -> bool:
        """Whether routed experts take their own FSDP mesh (experts_fsdp): with EP, which
        splits them, or TP, whose ranks share them beyond the dense FSDP mesh."""
        return self.ep > 1 or self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    # Meshes.
    def build_meshes(self, device_type: str) -> None:
        """Creates the world mesh and the experts' view; call once after init_process_group."""
        world = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        self._meshes["world"] = world
        self._meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        self._meshes["loss"] = world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("loss")
        # FSDP's mesh: (replicate, shard over dp_shard*cp) for HSDP, else the shard dim alone.
        # Its own root (same rank order), as slicing flattened dims out of a root is deprecated;
        # tp is taken from the same root, since FSDP2 shards tensor-parallel parameters only
        # over a mesh that shares their mesh's root (a 2-D layout).
        fsdp = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard * self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard_cp", "tp"),
        )
        self._meshes["tp"] = fsdp["tp"]
        fsdp_dims = ("dp_replicate", "dp_shard_cp") if self.dp_replicate > 1 else ("dp_shard_cp",)
        self._meshes["fsdp"] = fsdp[fsdp_dims]
        if self.experts_mesh_enabled:
            experts = self._experts_root(device_type)
            self._meshes["experts"] = experts
            self._meshes["experts_fsdp"] = (
                experts["dp_replicate", "efsdp"] if self.dp_replicate > 1 else experts["efsdp"]
            )

    def experts_ranks(self) -> torch.Tensor:
        """The experts' view as a rank grid [pp, dp_replicate, efsdp, ep]: efsdp gathers the
        dp_shard * cp ranks that hold the same experts with the tp ranks beside them, which in
        the world's row-major order are not one block (an ep group sits between two of its tp
        coordinates), so the grid is laid out explicitly."""
        shard = self.dp_shard * self.cp // self.ep
        grid = torch.arange(self.world_size).view(
            self.pp, self.dp_replicate, shard, self.ep, self.tp
        )
        return grid.permute(0, 1, 2, 4, 3).reshape(self.pp, self.dp_replicate, self.efsdp, self.ep)

    def _experts_root(self, device_type: str) -> DeviceMesh:
        names = ("pp", "dp_replicate", "efsdp", "ep")
        return DeviceMesh(device_type, self.experts_ranks(), mesh_dim_names=names)

    def mesh(self, name: str) -> DeviceMesh:
        """Named (sub-)mesh: world, pp, dp, dp_replicate, dp_shard, cp, tp, loss (dp x cp x tp),
        fsdp (1-D over dp_shard * cp, or HSDP 2-D), and with EP or TP: ep, efsdp, experts,
        experts_fsdp (1-D over efsdp, or HSDP 2-D)."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_meshes() has not been called")
        if name in self._meshes:
            return self._meshes[name]
        if name in ("pp", "dp_replicate", "dp_shard", "cp"):
            return self._meshes["world"][name]
        if name in ("ep", "efsdp") and "experts" in self._meshes:
            return self._meshes["experts"][name]
        raise KeyError(f"no mesh named {name!r}")

    def loss_group(self) -> dist.ProcessGroup | None:
        """The ranks whose tokens share one loss (dp x cp x tp: context and tensor parallel
        ranks each count their own slice of the sequence), or None on a single such rank."""
        return self.mesh("loss").get_group() if self.num_loss_ranks > 1 else None

    def pp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the other pipeline stages of this rank's model, or None without
        pipeline parallel."""
        return self.mesh("pp").get_group() if self.pp_enabled else None

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which batch shard it reads)."""
        return self.mesh("dp").get_local_rank() if self._meshes else 0

    def pp_rank(self) -> int:
        """This rank's index among the pipeline ranks (which stages it runs)."""
        return self.mesh("pp").get_local_rank() if self._meshes else 0

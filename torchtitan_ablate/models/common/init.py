"""Layout-independent weight initialisation: every parameter's initial value is a function of
the seed, the parameter's canonical name and its init rule only, whatever the mesh.

The rules (which distribution, which std) live in the model files' `init_weights(..., init)`,
which call `init.trunc_normal_(weight, std)`, `init.normal_(weight, std)` and
`init.uniform_(weight, bound)`. A `ParamInit` draws each parameter's FULL tensor from a generator
of its own, seeded by a stable hash of (seed, name), and copies this rank's part into the
parameter. So FSDP, HSDP, CP and EP shards (uneven ones included) hold exactly the slices of the
one-process tensors, and a parameter's value depends on no other parameter (a model with more
layers, LoRA adapters or float8 modules starts its common weights alike). DTensor's own random
ops would not do this: on CUDA its offset-based tracker fills a shard differently from a whole
tensor, and on CPU every shard would draw the same numbers.

Cost: one full parameter at a time, drawn in float32 on the run's device. Fake tensors (the memory
estimator) draw nothing.

Names are canonical: wrapper modules (activation checkpointing, torch.compile) add path parts
that checkpoints and the state-dict adapter never see; they are left out here too.
"""

import hashlib
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Path parts of wrapper modules: checkpoint_wrapper, torch.compile, FSDP1.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")

Draw = Callable[[torch.Tensor, torch.Generator], object]


def canonical_name(name: str) -> str:
    """`layers.0._orig_mod._checkpoint_wrapped_module.attention.wq.weight` ->
    `layers.0.attention.wq.weight` (the name in checkpoints)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def param_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, name): a stable hash (Python's hash() is salted per
    process), 63 bits."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ParamInit:
    """Fills the parameters of `module` by name-seeded generators (see the module docstring).

    seed: the run's seed (training.seed). device: where the full tensors are drawn (the run's
    device; default: where each parameter's local data lives). The values depend on the
    device type (CPU and CUDA generators differ), never on the mesh.
    """

    def __init__(
        self, module: nn.Module, seed: int, device: torch.device | str | None = None
    ) -> None:
        self.seed = seed
        self.device = None if device is None else torch.device(device)
        # Tied weights are one Parameter: named once, by its first name (tok_embeddings.weight).
        self.names = {id(p): canonical_name(n) for n, p in module.named_parameters()}

    def trunc_normal_(self, param: torch.Tensor, std: float) -> None:
        """Normal(0, std) truncated at 3 std (torchtitan-style init, relative cutoff)."""
        self.fill_(param, lambda t, g: nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, g))

    def normal_(self, param: torch.Tensor, std: float) -> None:
        self.fill_(param, lambda t, g: nn.init.normal_(t, 0.0, std, generator=g))

    def uniform_(self, param: torch.Tensor, bound: float) -> None:
        """U(-bound, bound)."""
        self.fill_(param, lambda t, g: nn.init.uniform_(t, -bound, bound, generator=g))

    @torch.no_grad()
    def fill_(self, param: torch.Tensor, draw: Draw) -> None:
        """Draws the full tensor with `draw(full, generator)` and keeps this rank's part."""
        if is_fake(param):  # shape only: no values to draw (and none to pay for)
            return
        name = self.names.get(id(param))
        if name is None:
            raise ValueError(
                f"ParamInit: a parameter of shape {tuple(param.shape)} is not in the module it "
                "was built for; build ParamInit on the module being initialised"
            )
        local = param.to_local() if isinstance(param, DTensor) else param
        device = self.device or local.device
        generator = torch.Generator(device=device).manual_seed(param_seed(self.seed, name))
        whole = local.shape == param.shape and local.device == device and local.is_contiguous()
        if whole and local.dtype == torch.float32 and type(local) in (torch.Tensor, nn.Parameter):
            draw(local, generator)  # this rank holds the whole float32 tensor: no copy
            return
        # float32 whatever the parameter's dtype: a float64 or bf16 copy holds the same values.
        full = torch.empty(param.shape, dtype=torch.float32, device=device)
        draw(full, generator)
        local.copy_(local_part(full, param))


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's block of `full` for `param` (the full tensor itself when not a DTensor).
    The offsets are DTensor's own (uneven shards and EP's expert sharding under FSDP included),
    so no communication is needed."""
    if not isinstance(param, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, param.device_mesh, param.placements
    )
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def init_for(module: nn.Module, init: ParamInit | None) -> ParamInit:
    """`init`, or for a module initialised on its own (tests), one seeded by torch's seed with
    names relative to `module`."""
    return init if init is not None else ParamInit(module, torch.initial_seed())

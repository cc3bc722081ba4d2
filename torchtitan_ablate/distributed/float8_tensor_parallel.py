"""Float8 x tensor parallel: torchao's float8 TP styles for apply_tp (torchtitan's scheme).

With the tensorwise recipe a Float8Linear scales each operand by one amax over the whole tensor.
Under sequence parallel its input is a DTensor sharded over the sequence; torchao's styles
(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput) cast it to float8 on
the shard, with the amax reduced over the tp ranks by DTensor, before the all-gather: so the
all-gather moves float8 bytes and every rank uses the scale the one-process run would. Backward
casts the output gradient the same way. The weight is sharded by the usual Colwise / Rowwise
placements; its amax is a DTensor reduction too.

CPU (gloo): gloo cannot all-gather float8 tensors ("Invalid scalar type"), so there the float8
linears keep the plain styles: the input is all-gathered in high precision and Float8Linear
casts the gathered DTensor with the same whole-tensor amax (the same scales, more bytes on the
wire). That is the path the CPU equivalence test proves; the float8-styles path runs on CUDA
(NCCL) only and is torchtitan's default there.

Rowwise recipes are refused with TP (config/rules.py): torchao's styles assume tensorwise
scaling, and rowwise through the plain styles (torchtitan's choice) is not equal to one process:
measured on CPU (debug model, TP 2), its step-1 loss is 3.4e-5 and its gradient norm 2e-4 off
(tensorwise: equal and 1.7e-5), so some per-row scale covers only a rank's shard.

torchao is optional, so it is imported only when float8 and TP are both on.
"""

from torch import nn

from torchtitan_ablate.distributed.tensor_parallel import PLAIN, TPStyles


def float8_tp_styles(device_type: str) -> tuple[TPStyles, type[nn.Module] | None]:
    """torchao's float8 styles and the module type they apply to (Float8Linear): apply_tp's
    `special` and `is_special`; the plain styles on CPU (see the module docstring)."""
    if device_type != "cuda":
        return PLAIN, None
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    styles = TPStyles(
        colwise=Float8ColwiseParallel,
        rowwise=Float8RowwiseParallel,
        prepare_input=PrepareFloat8ModuleInput,
    )
    return styles, Float8Linear

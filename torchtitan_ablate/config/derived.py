"""Settings whose meaning depends on another setting, interpreted here once: the build path,
the model recipes and the memory estimator ask these functions instead of re-deriving them."""

from torchtitan_ablate.config.job_config import Compile, Training

COMPILE_PARTS = ("model", "loss")


def resolved_loss_impl(training: Training) -> str:
    """training.loss_impl with "auto" resolved: chunked when loss_chunk_size > 0, else plain."""
    if training.loss_impl != "auto":
        return training.loss_impl
    return "chunked" if training.loss_chunk_size > 0 else "plain"


def compiles(compile_config: Compile, part: str) -> bool:
    """Whether torch.compile applies to `part` of the step ("model": each transformer block;
    "loss": the chunked or plain loss): compile.enable and the part in compile.components."""
    assert part in COMPILE_PARTS, part
    return compile_config.enable and part in compile_config.components

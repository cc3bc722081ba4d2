"""Compiled MoE blocks under activation checkpointing (components/compile.py): their frames are
compiled inside the checkpoint wrapper instead of falling back to eager, with the same
numbers as the uncompiled model."""

import pytest
import torch

from tests.helpers.tiny_qwen3 import MOE, initialised, meta_model
from torchtitan_ablate.components.compile import apply_compile
from torchtitan_ablate.distributed.activation_checkpoint import apply_ac
from torchtitan_ablate.models.common.init import canonical_name


class GraphRecorder:
    """A torch.compile backend that runs each graph as traced (no Inductor) and keeps its code."""

    def __init__(self) -> None:
        self.graphs: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm.code)
        return gm.forward


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = torch.arange(2 * 16).view(2, 16) % MOE.vocab_size
    loss = model(tokens).float().square().mean()
    loss.backward()
    grads = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("mode", ["full", "selective_2"])
def test_moe_blocks_under_whole_block_checkpoint_compile_their_experts(mode: str) -> None:
    torch._dynamo.reset()
    ref = meta_model(MOE)
    initialised(ref)
    model = meta_model(MOE)
    ac_mode, option = ("full", "1") if mode == "full" else ("selective", "2")
    apply_ac(model, ac_mode, option)
    recorder = GraphRecorder()
    apply_compile(model, fullgraph=False, backend=recorder)
    initialised(model)  # the same weights: initialisation goes by canonical name

    got_loss, got_grads = _loss_and_grads(model)
    ref_loss, ref_grads = _loss_and_grads(ref)

    # The experts' SwiGLU is traced (compiled around the count reads' graph breaks); compiled
    # around the checkpoint, a break sent the whole checkpointed block to eager and no graph
    # held it.
    assert any("silu" in code for code in recorder.graphs), recorder.graphs
    # Checkpoint names are unchanged: no compiler prefix inside the wrapper.
    assert not any("_checkpoint_wrapped_module._orig_mod" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-6, atol=0)
    assert got_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)

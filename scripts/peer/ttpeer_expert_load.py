"""Expert-load logging for the torchtitan 0.2.2 peer runs (scripts/peer_bench.sh), loaded as
torchtitan's `--experimental.custom_import ttpeer_expert_load` (it imports the peer's own
`ttpeer_flavors` first, which that option would otherwise load).

torchtitan 0.2.2 counts the tokens each MoE layer sends to each expert (`MoE.tokens_per_expert`)
but does not log them. Before each optimizer step this prints, on rank 0, the measure that
torchtitan_ablate logs as `expert_load_imbalance`: per layer the busiest expert's count over the
mean count (counts summed over all ranks since the last printed step), averaged over layers, and
the largest expert bias (torchtitan 0.2.2's Qwen3 builds its optimizers without the bias update,
so the bias stays 0 there: this shows it).

    [ttpeer_load] step 10 expert_load_imbalance 2.114 max_over_mean [...] max|expert_bias| 0.00e+00

A global optimizer pre-hook, so torchtitan's code stays as shipped; it runs before any hook of
torchtitan's own (which may reset the counts), at the OptimizersContainer's step only (not again
for the optimizers inside it); no host sync except on printed steps. Every rank runs it, so the
all-reduce matches on all of them.
"""

import gc
import os
import warnings

import torch
import torch.distributed as dist
import ttpeer_flavors  # noqa: F401  (the peer's flavors: this module replaces its import)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3.model.model import Qwen3Model

EVERY = int(os.environ.get("TTPEER_LOAD_FREQ", "5"))
_moes: list[MoE] = []
_last: list[torch.Tensor] = []
_pending: list[torch.Tensor] = []
_step = 0
_scanned = False


def _log_load(optimizer, _args, _kwargs) -> None:
    global _step, _scanned
    if not hasattr(optimizer, "optimizers"):
        return  # an optimizer inside torchtitan's OptimizersContainer: counted at the container
    if not _scanned:  # once: a dense model has none, and the scan costs a step's time
        _scanned = True
        with warnings.catch_warnings():  # the scan touches deprecated module attributes
            warnings.simplefilter("ignore")
            # type(), not isinstance(): a dead weakref proxy raises on __class__.
            models = [m for m in gc.get_objects() if issubclass(type(m), Qwen3Model)]
        _moes.extend(b.moe for m in models for b in m.layers.values() if b.moe_enabled)
        _last.extend(torch.zeros_like(m.tokens_per_expert) for m in _moes)
        _pending.extend(torch.zeros_like(m.tokens_per_expert) for m in _moes)
    if not _moes:
        return
    new = []
    for i, moe in enumerate(_moes):
        now = moe.tokens_per_expert.detach().clone()
        reset = (now < _last[i]).any()  # by a hook of torchtitan's since last time
        new.append(now - torch.where(reset, torch.zeros_like(now), _last[i]))
        _last[i] = now
    _step += 1
    for i, n in enumerate(new):
        _pending[i] += n
    if _step != 1 and _step % EVERY:
        return
    load_LE = torch.stack(_pending).float()
    if dist.is_initialized():
        dist.all_reduce(load_LE)
    per_layer = load_LE.max(dim=1).values / load_LE.mean(dim=1).clamp(min=1e-9)
    for p in _pending:
        p.zero_()
    if not dist.is_initialized() or dist.get_rank() == 0:
        layers = ", ".join(f"{x:.2f}" for x in per_layer.tolist())
        biases = [m.expert_bias.abs().max().item() for m in _moes if m.expert_bias is not None]
        print(
            f"[ttpeer_load] step {_step} expert_load_imbalance {per_layer.mean().item():.3f}"
            f" max_over_mean [{layers}] max|expert_bias| {max(biases, default=0.0):.2e}",
            flush=True,
        )


register_optimizer_step_pre_hook(_log_load)

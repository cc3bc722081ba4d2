"""Weight-decay param groups: who decays on the dense / MoE / LoRA / untied models, that a no-decay
parameter really keeps its value, the config key's rule, resume from old single-group checkpoints,
and FSDP on 2 gloo ranks equal to one process."""

import dataclasses
import logging

import pytest
import torch
from torch import nn

from tests.helpers.checkpoints import one_model_manager
from tests.helpers.distributed import captured_log, run_distributed
from tests.helpers.parallel_harness import assert_same_training, train_layout
from torchtitan_ablate.components.checkpoint.manager import CheckpointManager
from torchtitan_ablate.components.optim.optimizer import build_optimizer, decay_classes
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.config.job_config import Optimizer as OptimizerConfig
from torchtitan_ablate.models.common.lora import apply_lora
from torchtitan_ablate.models.common.norms import RMSNorm
from torchtitan_ablate.models.qwen3.args import qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model

DEFAULT = OptimizerConfig().no_decay


def _qwen3(flavor: str, **changes: object) -> Qwen3Model:
    with torch.device("meta"):
        return Qwen3Model(dataclasses.replace(qwen3_flavors[flavor], **changes))


def _exempt(model: nn.Module, no_decay: list[str] = DEFAULT) -> dict[str, str | None]:
    """FQN -> the class that exempts it (None: it decays)."""
    return {fqn: c for fqn, (_, c) in decay_classes([model], no_decay).items()}


def _norms(n_layers: int) -> set[str]:
    per_block = ("attention_norm", "ffn_norm", "attention.q_norm", "attention.k_norm")
    return {f"layers.{i}.{n}.weight" for i in range(n_layers) for n in per_block} | {"norm.weight"}


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_dense_and_moe_groups(flavor):
    model = _qwen3(flavor)
    got = _exempt(model)
    n = model.args.n_layers
    # Tied: output.weight is tok_embeddings.weight, listed once, as the embedding.
    assert "output.weight" not in got
    assert {k: c for k, c in got.items() if c} == {
        "tok_embeddings.weight": "embedding",
        **dict.fromkeys(_norms(n), "norm"),
    }
    decayed = {k for k, c in got.items() if c is None}
    assert "layers.0.attention.wq.weight" in decayed
    if flavor == "debugmodel_moe":  # expert weights [E, out, in] and the router gate: matrices
        for w in ("experts.w1", "experts.w2", "experts.w3", "router.gate.weight"):
            assert f"layers.{n - 1}.moe.{w}" in decayed
    assert len(got) == len(list(model.parameters()))  # every parameter, once


def test_untied_output_decays_unless_listed():
    model = _qwen3("debugmodel", tie_embeddings=False)
    assert _exempt(model)["output.weight"] is None
    assert _exempt(model, DEFAULT + ["output"])["output.weight"] == "output"
    assert _exempt(model, [])["tok_embeddings.weight"] is None  # [] decays everything
    tied = _qwen3("debugmodel")
    # With tied embeddings either entry exempts the one shared tensor.
    assert _exempt(tied, ["output"])["tok_embeddings.weight"] == "output"


def test_lora_groups_only_adapters_which_decay_unless_listed():
    model = _qwen3("debugmodel_moe")
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "experts"])
    got = _exempt(model)
    assert got and all(".lora_" in k for k in got)  # frozen base weights, norms included: absent
    assert "layers.0.moe.experts.lora_a_w1" in got
    assert all(c is None for c in got.values())
    assert set(_exempt(model, ["lora"]).values()) == {"lora"}


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = RMSNorm(4)
        self.proj = nn.Linear(4, 4, bias=True)


def _toy_optimizer(seed: int = 0, **config: object) -> tuple[_Toy, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Toy()
    nn.init.normal_(model.norm.weight, 1.0, 0.1)
    return model, build_optimizer([model], OptimizerConfig(**config), "cpu")


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_zero_gradient_step_decays_only_the_decay_group(impl, name):
    lr, wd = 0.1, 0.5
    model, opt = _toy_optimizer(name=name, lr=lr, weight_decay=wd, implementation=impl)
    assert [g["weight_decay"] for g in opt.param_groups] == [wd, 0.0]
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for k, p in model.named_parameters():
        if k == "proj.weight":
            if name == "AdamW":  # decoupled: w <- w (1 - lr wd), the Adam update of 0 is 0
                torch.testing.assert_close(p, before[k] * (1 - lr * wd))
            else:  # L2: the gradient becomes wd w, and Adam's first step moves each w by ~lr
                assert (p - before[k]).abs().min() > 0.9 * lr
        else:
            assert torch.equal(p, before[k]), k


def test_start_up_line_states_the_split(caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan_ablate"):
        _toy_optimizer()
        _toy_optimizer(no_decay=[])
        _toy_optimizer(weight_decay=0.0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight decay")]
    assert lines == [
        "weight decay 0.1 on 1 tensors (16 parameters), none on 3 tensors (48 parameters) "
        "(optimizer.no_decay = ['norm', 'bias', 'embedding']: norm 1, bias 1, embedding 1)",
        "weight decay 0.1 on 4 tensors (64 parameters), none on 0 tensors (0 parameters) "
        "(optimizer.no_decay = [])",
        "weight decay: none (optimizer.weight_decay = 0) on 4 tensors (64 parameters)",
    ]


def test_no_decay_key_is_validated():
    assert load_config([]).optimizer.no_decay == ["norm", "bias", "embedding"]
    assert load_config(["--optimizer.no_decay", ""]).optimizer.no_decay == []
    ok = load_config(["--optimizer.no_decay", "norm,lora,output"])
    assert ok.optimizer.no_decay == ["norm", "lora", "output"]
    with pytest.raises(ConfigError, match=r"optimizer.no_decay = \['norm', 'layernorm'\]"):
        load_config(["--optimizer.no_decay", "norm,layernorm"])


def _train(model: _Toy, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        h = model.norm(model.emb(torch.tensor([[1, 2, 3]])))
        model.proj(h).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _manager(folder, model: _Toy, opt: torch.optim.Optimizer) -> CheckpointManager:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return one_model_manager(folder, model, opt, sched)


def _moments(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    return {k: {n: v.clone() for n, v in opt.state[p].items()} for k, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("saved_no_decay", ["old single group", [], DEFAULT])
@pytest.mark.parametrize("loaded_no_decay", [[], DEFAULT])
def test_resume_across_group_layouts(tmp_path, saved_no_decay, loaded_no_decay):
    """Optimizer state is keyed by FQN, so a checkpoint loads whatever the groups were: the
    single group written before this key existed (the old code's AdamW(params)) included. The
    moments and steps are the checkpoint's, each group's settings this run's."""
    model, opt = _toy_optimizer()
    if saved_no_decay == "old single group":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), foreach=True)
        opt.param_groups[0]["weight_decay"] = 0.1
    else:
        model, opt = _toy_optimizer(no_decay=saved_no_decay)
    _train(model, opt, 3)
    _manager(tmp_path, model, opt).save(3)
    saved = _moments(model, opt)

    model, opt = _toy_optimizer(seed=1, no_decay=loaded_no_decay)
    manager = _manager(tmp_path, model, opt)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert manager.load() == 3
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == fresh
    got = _moments(model, opt)
    for k in saved:
        for n in saved[k]:
            torch.testing.assert_close(got[k][n], saved[k][n], rtol=0, atol=0)
    _train(model, opt, 1)  # and it steps on


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_with_groups_is_exact(tmp_path):
    model, opt = _toy_optimizer()
    _train(model, opt, 3)
    _manager(tmp_path, model, opt).save(3)
    _train(model, opt, 2)
    resumed, opt2 = _toy_optimizer(seed=1)
    _manager(tmp_path, resumed, opt2).load()
    _train(resumed, opt2, 2)
    for (k, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), k


def _fsdp_run(folder: str, args: list[str]) -> dict:
    """train_layout, plus this rank's start-up weight-decay line."""
    with captured_log() as lines:
        out = train_layout(folder, args)
    return {**out, "line": [m for m in lines if m.startswith("weight decay")]}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_fsdp_two_ranks_match_one_process(tmp_path, flavor):
    """Large decay so a norm or embedding put in the wrong group on a sharded layout shows in
    the parameters; the groups (global counts) are the same on every rank and layout."""
    args = ["--model.flavor", flavor, "--optimizer.weight_decay", "1.0"]
    args += ["--model.moe_aux_loss_coef", "0"] if flavor == "debugmodel_moe" else []
    ref = run_distributed(_fsdp_run, 1, str(tmp_path / "one"), args)[0]
    out = run_distributed(_fsdp_run, 2, str(tmp_path / "fsdp"), args)
    n_exempt = 4 * 4 + 1 + 1  # 4 norms per block, the final norm, the (tied) embedding
    assert f"none on {n_exempt} tensors" in ref["line"][0]
    assert all(o["line"] == ref["line"] for o in out)
    assert_same_training(out[0], ref)


def _local_shard_vs_dtensor_step(impl: str) -> dict[str, bool]:
    """On 2 ranks: Shard(0) parameters step bitwise as torch's AdamW on DTensors; a group with a
    Partial gradient (which the DTensor step all-reduces) is stepped as DTensors too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from torchtitan_ablate.components.optim.optimizer import LocalShardAdamW

    mesh = init_device_mesh("cpu", (2,))
    rank = torch.distributed.get_rank()
    same = {}
    for case, placement in (("sharded", Shard(0)), ("partial grad", Replicate())):
        params = {}
        for cls in (torch.optim.AdamW, LocalShardAdamW):
            torch.manual_seed(0)
            ps = [nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [placement]))]
            opt = cls(ps, lr=0.1, weight_decay=0.1, **{impl: True})
            for step in range(3):
                g = torch.full_like(ps[0].to_local(), float(rank + step + 1))
                grad_placement = Partial() if case == "partial grad" else placement
                ps[0].grad = type(ps[0]).from_local(g, mesh, [grad_placement])
                opt.step()
            params[cls] = ps[0].full_tensor()
        same[case] = torch.equal(*params.values())
    return same


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_local_shard_step_equals_dtensor_step(impl):
    assert (
        run_distributed(_local_shard_vs_dtensor_step, 2, impl)
        == [{"sharded": True, "partial grad": True}] * 2
    )

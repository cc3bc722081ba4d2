"""Layout-independent init (models/common/init.py): a parameter's initial value depends on the
seed, its canonical name and its rule only: not on the other parameters, the order of the
draws, wrapper modules, its dtype, or the global RNG. Fake tensors draw nothing."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.helpers.tiny_qwen3 import ARGS, MOE, initialised, meta_model
from torchtitan_ablate.components.compile import apply_compile
from torchtitan_ablate.distributed.activation_checkpoint import apply_ac
from torchtitan_ablate.models.common.init import ParamInit, canonical_name
from torchtitan_ablate.models.common.lora import apply_lora, init_lora_weights
from torchtitan_ablate.models.qwen3 import Qwen3ModelArgs


@pytest.mark.parametrize("args", [ARGS, MOE], ids=["dense", "moe"])
def test_value_is_a_function_of_seed_and_name_only(args: Qwen3ModelArgs) -> None:
    ref = initialised(meta_model(args))
    torch.manual_seed(123)  # the global RNG plays no part
    again = initialised(meta_model(args))
    fewer = initialised(meta_model(dataclasses.replace(args, n_layers=1)))
    tied = initialised(meta_model(dataclasses.replace(args, tie_embeddings=True)))
    other_seed = initialised(meta_model(args), seed=8)
    for key, t in ref.items():
        assert torch.equal(again[key], t), key
        if key in fewer:  # a subset of the parameters: the same values
            assert torch.equal(fewer[key], t), key
        assert not torch.equal(other_seed[key], t) or t.unique().numel() == 1, key
    assert len(fewer) < len(ref)
    # Tied, the same draw at the output projection's std (0.02 against untied N(0, 1)).
    torch.testing.assert_close(tied["tok_embeddings.weight"], ref["tok_embeddings.weight"] * 0.02)
    assert torch.equal(tied["output.weight"], tied["tok_embeddings.weight"])
    # Different names draw different numbers (same shape, same rule).
    wq = [ref[f"layers.{i}.attention.wq.weight"] for i in (0, 1)]
    assert not torch.equal(*wq)


def test_draw_order_and_dtype_do_not_matter() -> None:
    model = meta_model(ARGS)
    model.to_empty(device="cpu")
    init = ParamInit(model, 7)
    weights = [b.attention.wq.weight for b in model.layers.values()]
    for w in reversed(weights):  # the opposite order to init_weights
        init.trunc_normal_(w, 0.02)
    ref = initialised(meta_model(ARGS))
    for i, w in enumerate(weights):
        assert torch.equal(w, ref[f"layers.{i}.attention.wq.weight"])
    wide = meta_model(ARGS).to_empty(device="cpu").double()
    wide.init_weights(init=ParamInit(wide, 7))
    assert torch.equal(
        wide.layers["1"].feed_forward.w2.weight.float(), ref["layers.1.feed_forward.w2.weight"]
    )


def test_wrappers_keep_the_canonical_names() -> None:
    assert canonical_name("layers.3._orig_mod._checkpoint_wrapped_module.moe.experts.w1") == (
        "layers.3.moe.experts.w1"
    )
    wrapped = meta_model(MOE)
    apply_ac(wrapped, "selective", "2")  # blocks 0 and 2 checkpointed
    apply_compile(wrapped, fullgraph=False)  # lazy: nothing compiles before a forward
    names = [n for n, _ in wrapped.named_parameters()]
    assert any(n.startswith("layers.0._checkpoint_wrapped_module.") for n in names)
    assert any(n.startswith("layers.1._orig_mod.") for n in names)
    got, ref = initialised(wrapped), initialised(meta_model(MOE))
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_lora_leaves_the_base_weights_and_seeds_adapters_by_name() -> None:
    ref = initialised(meta_model(MOE))
    model = meta_model(MOE)
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "experts"])
    apply_ac(model, "full", "2")
    model.to_empty(device="cpu")
    init = ParamInit(model, 7)
    model.init_weights(init=init)
    init_lora_weights(model, init)
    got = {canonical_name(k): v for k, v in model.state_dict().items()}
    assert {k for k in got if k not in ref} and all(".lora_" in k for k in got if k not in ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    plain = meta_model(MOE)  # adapters too are seeded by their canonical names
    apply_lora(plain, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "experts"])
    plain.to_empty(device="cpu")
    init_lora_weights(plain, ParamInit(plain, 7))
    a = "layers.1.moe.experts.lora_a_w2"
    assert torch.equal(got[a], plain.state_dict()[a]) and got[a].abs().sum() > 0
    assert got["layers.0.attention.wq.lora_b"].abs().sum() == 0


def test_fake_tensors_draw_nothing_and_foreign_parameters_are_refused() -> None:
    model = meta_model(MOE)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        init = ParamInit(model, 7)

        def no_draw(t, g):
            raise AssertionError("drew values for a fake tensor")

        for p in model.parameters():
            init.fill_(p, no_draw)
        model.init_weights(init=init)
    real = meta_model(ARGS).to_empty(device="cpu")
    with pytest.raises(ValueError, match="not in the module"):
        ParamInit(real, 7).normal_(torch.nn.Parameter(torch.empty(3)), 1.0)

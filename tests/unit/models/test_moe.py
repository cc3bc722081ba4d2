"""MoE: both expert paths equal a per-token reference; router, aux loss, counts, expert bias."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from torchtitan_ablate.models.common.experts import GROUP_ALIGN_ROWS, GroupedExperts, padded_layout
from torchtitan_ablate.models.common.moe import MoE
from torchtitan_ablate.models.common.permute import inverse_permutation

D, HIDDEN, E, TOPK = 16, 32, 4, 2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_moe(coef: float = 0.01, bias: bool = False, dtype=torch.float32, device="cpu") -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, HIDDEN, E, TOPK, norm_topk_prob=True, aux_loss_coef=coef, use_expert_bias=bias)
    moe.init_weights(init_std=0.02)
    with torch.no_grad():  # larger weights than the init so outputs are far from zero
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe.to(device, dtype)


def reference(moe: MoE, x_BSD: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalise, weighted sum of the chosen SwiGLU experts."""
    x_TD = x_BSD.reshape(-1, D).float()
    ex = moe.experts
    out_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        probs_E = F.softmax(moe.router.gate.weight.float() @ x_TD[t], dim=-1)
        top_w, top_e = probs_E.topk(TOPK)
        for w, e in zip(top_w / top_w.sum(), top_e.tolist()):
            h_I = F.silu(ex.w1[e].float() @ x_TD[t]) * (ex.w3[e].float() @ x_TD[t])
            out_TD[t] += w * (ex.w2[e].float() @ h_I)
    return out_TD.view(x_BSD.shape)


def x_input(dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1)).to(device, dtype)


@pytest.mark.parametrize("grouped", [False, True])
def test_matches_per_token_reference(grouped: bool) -> None:
    moe = make_moe()
    moe.experts.force_grouped_mm = grouped  # torch._grouped_mm runs on CPU in fp32 too
    x = x_input()
    torch.testing.assert_close(moe(x), reference(moe, x), atol=1e-5, rtol=1e-5)


def test_grouped_equals_loop_with_grads_and_empty_experts() -> None:
    results = []
    for grouped in (False, True):
        moe = make_moe(bias=True)
        moe.expert_bias[1] = -10.0  # expert 1 never chosen: an empty group
        moe.experts.force_grouped_mm = grouped
        x = x_input().requires_grad_()
        out = moe(x)
        (out.square().sum() + moe.aux_loss).backward()
        results.append([out, x.grad] + [p.grad for p in moe.parameters()])
    assert moe.tokens_per_expert[1] == 0
    for loop_t, grouped_t in zip(*results):
        assert torch.isfinite(grouped_t).all()
        torch.testing.assert_close(grouped_t, loop_t, atol=1e-5, rtol=1e-5)
    assert all(g.abs().sum() > 0 for g in results[0][2:])  # router and all experts' weights


def test_grouped_bf16_close_to_loop() -> None:
    moe = make_moe(dtype=torch.bfloat16)
    x = x_input(torch.bfloat16)
    loop = moe(x)
    moe.experts.force_grouped_mm = True
    torch.testing.assert_close(moe(x), loop, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_experts_place_unsorted_rows_by_rank(grouped: bool) -> None:
    """Rows in any order with their rank in expert order (expert parallel's received rows) give
    the sorted computation's rows back in their own order, values and gradients (float32: the
    grouped GEMM takes no float64)."""
    torch.manual_seed(0)
    experts = GroupedExperts(8, 16, 4, grouped_mm=grouped)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    counts = torch.tensor([3, 0, 5, 2])
    x_sorted = torch.randn(10, 8)
    rank = torch.randperm(10)  # row i of the unsorted input is the rank[i]-th sorted row
    x = x_sorted[rank].detach().requires_grad_()
    x_ref = x_sorted.clone().requires_grad_()
    g = torch.randn(10, 8)
    got = experts.run_rows(x, counts, rank)
    (got * g).sum().backward()
    ref = experts.run_rows(x_ref, counts)
    (ref * g[inverse_permutation(rank)]).sum().backward()
    # The same rows meet the same kernels in the same groups: equal, not just close.
    torch.testing.assert_close(got, ref[rank], rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad[rank], rtol=0, atol=0)


def testpadded_layout() -> None:
    counts_E = torch.tensor([3, 0, 17, 1])
    dest_R, offs_E = padded_layout(counts_E, 21)
    assert offs_E.dtype == torch.int32 and offs_E.tolist() == [16, 16, 48, 64]
    assert dest_R.tolist() == [0, 1, 2] + list(range(16, 33)) + [48]
    assert all(o % GROUP_ALIGN_ROWS == 0 for o in offs_E.tolist())


def test_aux_loss_equals_hf_formula() -> None:
    moe = make_moe(coef=0.01)
    x = x_input()
    moe(x)
    logits_TE = x.reshape(-1, D) @ moe.router.gate.weight.T
    expected = 0.01 * load_balancing_loss_func((logits_TE,), E, TOPK)
    torch.testing.assert_close(moe.aux_loss, expected)
    assert not moe.aux_loss.requires_grad  # logged value; the gradient rides on the output
    assert make_moe(coef=0.0)(x) is not None and make_moe(coef=0.0).aux_loss is None


def test_aux_loss_gradient_rides_on_the_output() -> None:
    """Backward through the layer output gives the router exactly the gradient of
    out + scale * aux, with aux never added to the loss by hand."""
    moe = make_moe(coef=0.01)
    moe.aux_loss_scale = 0.5
    x = x_input()
    moe(x).sum().backward()
    got = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    moe.aux_loss_coef = 0.0  # the same layer without the attached aux loss
    y = moe(x)
    logits_TE = x.reshape(-1, D) @ moe.router.gate.weight.T
    aux = 0.01 * load_balancing_loss_func((logits_TE,), E, TOPK)
    (y.sum() + 0.5 * aux).backward()
    torch.testing.assert_close(got, moe.router.gate.weight.grad, atol=1e-6, rtol=1e-5)


def test_tokens_per_expert_accumulate_and_reset() -> None:
    moe = make_moe()
    x = x_input()
    moe(x)
    assert moe.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * TOPK
    moe(x)
    assert moe.tokens_per_expert.sum() == 2 * x.shape[0] * x.shape[1] * TOPK
    moe.reset_expert_load()
    assert moe.tokens_per_expert.sum() == 0


def test_expert_bias_changes_selection_not_weights() -> None:
    moe = make_moe(bias=True)
    x_TD = x_input().reshape(-1, D)
    probs_TE, _, _ = moe.router(x_TD, None)
    bias_E = torch.tensor([0.0, 0.0, 0.0, 5.0])
    biased_probs_TE, weights_TK, experts_TK = moe.router(x_TD, bias_E)
    assert (experts_TK == 3).any(dim=1).all()  # the biased expert is always chosen
    torch.testing.assert_close(biased_probs_TE, probs_TE)
    chosen_TK = probs_TE.gather(1, experts_TK)
    torch.testing.assert_close(weights_TK, chosen_TK / chosen_TK.sum(-1, keepdim=True))


def test_update_expert_bias() -> None:
    moe = make_moe(bias=True)
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    moe.update_expert_bias(0.1)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    with pytest.raises(ValueError, match="moe_bias_update_rate"):
        make_moe(bias=False).update_expert_bias(0.1)


@pytest.mark.gpu
@cuda
def test_cuda_grouped_mm_matches_loop() -> None:
    moe = make_moe(dtype=torch.bfloat16, device="cuda")
    x = x_input(torch.bfloat16, "cuda")
    moe.experts.force_grouped_mm = False
    loop = moe(x)
    moe.experts.force_grouped_mm = None  # automatic: grouped on CUDA bf16
    torch.testing.assert_close(moe(x), loop, atol=2e-2, rtol=2e-2)

"""The estimator's verdict: fits or not, and the warning when the predicted peak leaves less room
than the caching allocator needs (the run starts but runs slower)."""

from torchtitan_ablate.estimator.verdict import verdict


def est(peak_gib: float, ep: bool) -> dict:
    return {"peak_gib": peak_gib, "context_gib": 0.5, "expert_parallel": ep}


def test_does_not_fit_names_the_need():
    fits, line = verdict(est(80.0, ep=False), 80.0)
    assert not fits and line == "does not fit in 80 GiB (needs 80.5 GiB)"


def test_room_to_spare_has_no_warning():
    fits, line = verdict(est(60.0, ep=True), 80.0)
    assert fits and line == "fits in 80 GiB with 24% headroom"


def test_expert_parallel_near_the_card_warns_where_one_rank_experts_do_not():
    # The EP 4 recipe's measured active peak on an 80 GB card: 67.1 GiB active ran 96% reserved.
    fits, line = verdict(est(67.1, ep=True), 79.2)
    warning = "allocator needs about 78 GiB reserved for an expert-parallel step (98% of the card)"
    assert fits and warning in line
    fits, line = verdict(est(67.1, ep=False), 79.2)
    assert fits and "allocator" not in line


def test_one_gpu_moe_recipe_fits_without_warning():
    # qwen3_moe_1gpu.toml on a capped H200: 69.8 GiB active ran 71.2 reserved (1.02x).
    fits, line = verdict(est(69.8, ep=False), 79.2)
    assert fits and "allocator" not in line

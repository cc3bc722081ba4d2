"""The estimator's verdict: fits or not, and the warning when the predicted peak leaves less room
than the caching allocator needs (the run starts but runs slower)."""

from torchtitan_ablate.estimator.verdict import verdict


def est(peak_gib: float, moe: bool) -> dict:
    return {"peak_gib": peak_gib, "context_gib": 0.5, "moe": moe}


def test_does_not_fit_names_the_need():
    fits, line = verdict(est(80.0, moe=False), 80.0)
    assert not fits and line == "does not fit in 80 GiB (needs 80.5 GiB)"


def test_room_to_spare_has_no_warning():
    fits, line = verdict(est(60.0, moe=True), 80.0)
    assert fits and line == "fits in 80 GiB with 24% headroom"


def test_moe_near_the_card_warns_where_dense_does_not():
    # The EP 4 recipe's measured active peak on an 80 GB card: 67.1 GiB active ran 96% reserved.
    fits, line = verdict(est(67.1, moe=True), 79.2)
    assert (
        fits and "allocator needs about 78 GiB reserved for an MoE step (98% of the card)" in line
    )
    fits, line = verdict(est(67.1, moe=False), 79.2)
    assert fits and "allocator" not in line
